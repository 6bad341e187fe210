//! Remote models (issue 24): objects of an S3-compatible store or an HTTP
//! server, served as local files by `hyperoffload mount` through a local cache tier.
//!
//! The decisions are here, pure and unit-tested: which blocks a read needs and which to
//! read ahead (`block_plan`), when to retry (`retry`), whether an answer is of the
//! version opened (`consistency`), the cache index's format (`cache_index`), the
//! eviction order (`eviction`: least recently used, and `graph_eviction`: by the pass
//! of a model, which `model_pass` reads from a GGUF header), the source's names
//! (`source`), the mount's tree (`tree`) and whether an open is answered with FUSE
//! passthrough to the cache file (`passthrough`). `cache_store` keeps the cache files. The
//! network (object_store) and FUSE (fuser) glue is the binary's, `src/cli/mount/`.

pub mod aws_config;
pub mod block_plan;
pub mod cache_index;
pub mod cache_store;
pub mod consistency;
pub mod eviction;
pub mod graph_eviction;
pub mod model_pass;
pub mod passthrough;
pub mod retry;
pub mod source;
pub mod tree;
