//! The learned-graph file loader on arbitrary bytes: it must return an error or a graph,
//! never panic, and a graph it accepts must be usable.
#![no_main]

use std::path::Path;

use hyperoffload::graph::store::decode;
use hyperoffload::graph::ModelGraph;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(saved) = decode(text, Path::new("fuzz.hyperoffload-graph")) {
        // Keep the graphs small enough to build quickly; the loader itself bounds nothing
        // about the model's size, which is the model's business.
        if saved.layout.block_count() <= 1 << 16 {
            let graph = ModelGraph::learned(saved.layout, &saved.transitions);
            let _ = graph.order().len();
        }
    }
});
