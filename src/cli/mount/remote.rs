//! The remote store through `object_store`: HEAD, listing and conditional ranged GETs,
//! retried on `hyperoffload::remote::retry`'s schedule (object_store's own retries are
//! off, so one schedule and one deadline govern every request).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures::TryStreamExt;
use hyperoffload::remote::consistency::{self, Verdict};
use hyperoffload::remote::retry::{Next, Retry, RetryPolicy};
use hyperoffload::remote::source::Source;
use object_store::path::Path as StorePath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig};

/// One object as the mount opened it.
#[derive(Debug, Clone)]
pub struct ObjectInfo {
    /// The name in the mount.
    pub name: String,
    pub key: StorePath,
    pub size: u64,
    /// The ETag at open: every ranged GET is conditional on it.
    pub etag: String,
    pub modified: std::time::SystemTime,
}

/// Why a remote read failed for good.
#[derive(Debug, Clone)]
pub enum FetchError {
    /// The object is not the version opened any more.
    Changed {
        name: String,
        opened: String,
        now: Option<String>,
    },
    /// Retries exhausted (or an error that retrying cannot fix).
    Failed {
        name: String,
        range: Range<u64>,
        attempts: u32,
        elapsed: Duration,
        error: String,
    },
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Changed { name, opened, now } => write!(
                f,
                "{name} changed on the remote (opened at ETag {opened}, now {}): its reads fail \
                 with EIO until it is mounted again",
                now.as_deref().unwrap_or("another")
            ),
            Self::Failed {
                name,
                range,
                attempts,
                elapsed,
                error,
            } => write!(
                f,
                "{name}: bytes {}..{}: {error} ({attempts} attempt{} in {:.1} s): EIO",
                range.start,
                range.end,
                if *attempts == 1 { "" } else { "s" },
                elapsed.as_secs_f64()
            ),
        }
    }
}

/// What went to the remote, for the summary and the tests.
#[derive(Debug, Default)]
pub struct RemoteStats {
    pub heads: AtomicU64,
    pub gets: AtomicU64,
    pub bytes: AtomicU64,
    pub retries: AtomicU64,
    pub failures: AtomicU64,
}

pub struct Remote {
    store: Arc<dyn ObjectStore>,
    pub source: Source,
    pub policy: RetryPolicy,
    pub stats: RemoteStats,
}

impl Remote {
    /// A client for `source`: S3 from the AWS environment variables and shared config
    /// files (`AWS_PROFILE`, `AWS_CONFIG_FILE`, `AWS_SHARED_CREDENTIALS_FILE`), HTTP as is.
    pub fn new(source: Source, policy: RetryPolicy) -> anyhow::Result<Self> {
        // object_store's retries off: ours (with the deadline) are the only ones.
        let retry = RetryConfig {
            max_retries: 0,
            retry_timeout: policy.deadline,
            ..RetryConfig::default()
        };
        let client = ClientOptions::new()
            .with_timeout(policy.attempt_timeout)
            .with_connect_timeout(policy.attempt_timeout.min(Duration::from_secs(5)));
        let store: Arc<dyn ObjectStore> = match &source {
            Source::Http { base } => Arc::new(
                object_store::http::HttpBuilder::new()
                    .with_url(base.clone())
                    .with_client_options(client.with_allow_http(base.starts_with("http://")))
                    .with_retry(retry)
                    .build()
                    .with_context(|| format!("HTTP source {base}"))?,
            ),
            Source::S3 { bucket, .. } => {
                let mut builder = object_store::aws::AmazonS3Builder::from_env();
                let mut endpoint = std::env::var("AWS_ENDPOINT_URL")
                    .or_else(|_| std::env::var("AWS_ENDPOINT"))
                    .ok();
                for (var, value) in aws_file_settings() {
                    if std::env::var_os(var).is_none() {
                        if var == "AWS_ENDPOINT_URL" {
                            endpoint.get_or_insert(value.clone());
                        }
                        if let Ok(key) = var.to_ascii_lowercase().parse() {
                            builder = builder.with_config(key, value);
                        }
                    }
                }
                let plain = endpoint
                    .as_deref()
                    .is_some_and(|e| e.starts_with("http://"));
                Arc::new(
                    builder
                        .with_bucket_name(bucket.clone())
                        .with_client_options(client.with_allow_http(plain))
                        .with_retry(retry)
                        .build()
                        .with_context(|| format!("S3 bucket {bucket}"))?,
                )
            }
        };
        Ok(Self {
            store,
            source,
            policy,
            stats: RemoteStats::default(),
        })
    }

    /// The names of the objects under an S3 prefix (no listing over plain HTTP).
    pub async fn list(&self) -> anyhow::Result<Vec<String>> {
        let Source::S3 { prefix, .. } = &self.source else {
            anyhow::bail!("an HTTP source has no listing: name the objects with --object");
        };
        let prefix = (!prefix.is_empty()).then(|| StorePath::from(prefix.as_str()));
        let listed: Vec<_> = tokio::time::timeout(
            self.policy.deadline,
            self.store.list(prefix.as_ref()).try_collect::<Vec<_>>(),
        )
        .await
        .context("listing the bucket timed out")?
        .context("listing the bucket")?;
        let mut names: Vec<String> = listed
            .iter()
            .filter_map(|meta| self.source.name_of(meta.location.as_ref()))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Size and ETag of object `name` (retried like a read).
    pub async fn head(&self, name: &str) -> anyhow::Result<ObjectInfo> {
        let key = store_path(&self.source.key(name));
        let started = Instant::now();
        let mut attempt = 0;
        let mut timeout = self.policy.first_timeout();
        loop {
            self.stats.heads.fetch_add(1, Ordering::Relaxed);
            let result = tokio::time::timeout(timeout, self.store.head(&key)).await;
            let error = match result {
                Ok(Ok(meta)) => {
                    let etag = meta.e_tag.with_context(|| {
                        format!(
                            "{name}: the remote gives it no ETag, so a change could not be told"
                        )
                    })?;
                    return Ok(ObjectInfo {
                        name: name.to_string(),
                        key,
                        size: meta.size,
                        etag,
                        modified: meta.last_modified.into(),
                    });
                }
                Ok(Err(error)) => error,
                Err(_) => timeout_error(timeout),
            };
            match self
                .policy
                .next(attempt, classify(&error), started.elapsed())
            {
                Next::GiveUp => {
                    return Err(anyhow::Error::new(error).context(format!(
                        "{name}: HEAD {} ({} attempts)",
                        key,
                        attempt + 1
                    )))
                }
                Next::RetryAfter {
                    delay,
                    timeout: next,
                } => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(delay).await;
                    timeout = next;
                    attempt += 1;
                }
            }
        }
    }

    /// Bytes `range` of `object`, of the version it was opened at, retried with backoff
    /// until the policy's deadline.
    pub async fn get(&self, object: &ObjectInfo, range: Range<u64>) -> Result<Bytes, FetchError> {
        let started = Instant::now();
        let mut attempt = 0u32;
        let mut timeout = self.policy.first_timeout();
        loop {
            self.stats.gets.fetch_add(1, Ordering::Relaxed);
            let error =
                match tokio::time::timeout(timeout, self.get_once(object, range.clone())).await {
                    Ok(Ok(bytes)) => {
                        self.stats
                            .bytes
                            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        return Ok(bytes);
                    }
                    Ok(Err(Attempt::Changed(now))) => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        return Err(FetchError::Changed {
                            name: object.name.clone(),
                            opened: object.etag.clone(),
                            now,
                        });
                    }
                    Ok(Err(Attempt::Error(error))) => error,
                    Err(_) => timeout_error(timeout),
                };
            match self
                .policy
                .next(attempt, classify(&error), started.elapsed())
            {
                Next::GiveUp => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    return Err(FetchError::Failed {
                        name: object.name.clone(),
                        range,
                        attempts: attempt + 1,
                        elapsed: started.elapsed(),
                        error: error.to_string(),
                    });
                }
                Next::RetryAfter {
                    delay,
                    timeout: next,
                } => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(delay).await;
                    timeout = next;
                    attempt += 1;
                }
            }
        }
    }

    /// The whole of `object` (the version opened) in one streaming GET, written to
    /// `dest` as it arrives: what a node does that copies a model before running it.
    /// Not retried (a download that fails fails the caller); each step (the answer, then
    /// every chunk of the body) may take the policy's attempt timeout. Returns the
    /// bytes written, counted in the stats as a GET's.
    pub async fn download(
        &self,
        object: &ObjectInfo,
        dest: &std::path::Path,
    ) -> anyhow::Result<u64> {
        use std::io::Write as _;
        let step = self.policy.attempt_timeout;
        let options = GetOptions {
            if_match: Some(object.etag.clone()),
            ..GetOptions::default()
        };
        self.stats.gets.fetch_add(1, Ordering::Relaxed);
        let result = tokio::time::timeout(step, self.store.get_opts(&object.key, options))
            .await
            .map_err(|_| timeout_error(step))
            .and_then(|result| result)
            .with_context(|| format!("{}: GET {}", object.name, object.key))?;
        let mut file = std::io::BufWriter::with_capacity(
            8 << 20,
            std::fs::File::create(dest).with_context(|| format!("creating {}", dest.display()))?,
        );
        let mut stream = result.into_stream();
        let mut written = 0u64;
        loop {
            let chunk = tokio::time::timeout(step, stream.try_next())
                .await
                .map_err(|_| timeout_error(step))
                .and_then(|chunk| chunk)
                .with_context(|| {
                    format!("{}: GET {} after {written} bytes", object.name, object.key)
                })?;
            let Some(chunk) = chunk else { break };
            file.write_all(&chunk)
                .with_context(|| format!("writing {}", dest.display()))?;
            written += chunk.len() as u64;
            self.stats
                .bytes
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        file.flush()
            .with_context(|| format!("writing {}", dest.display()))?;
        if written != object.size {
            anyhow::bail!(
                "{}: GET {} gave {written} bytes, the object has {}",
                object.name,
                object.key,
                object.size
            );
        }
        Ok(written)
    }

    async fn get_once(&self, object: &ObjectInfo, range: Range<u64>) -> Result<Bytes, Attempt> {
        let options = GetOptions {
            if_match: Some(object.etag.clone()),
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let result = match self.store.get_opts(&object.key, options).await {
            Ok(result) => result,
            Err(object_store::Error::Precondition { .. }) => return Err(Attempt::Changed(None)),
            Err(error) => return Err(Attempt::Error(error)),
        };
        if let Verdict::Changed { now, .. } =
            consistency::judge(&object.etag, false, result.meta.e_tag.as_deref())
        {
            return Err(Attempt::Changed(now));
        }
        if result.range != range {
            return Err(Attempt::Error(object_store::Error::Generic {
                store: "remote",
                source: format!("asked for bytes {range:?}, got {:?}", result.range).into(),
            }));
        }
        let bytes = result.bytes().await.map_err(Attempt::Error)?;
        if bytes.len() as u64 != range.end - range.start {
            return Err(Attempt::Error(object_store::Error::Generic {
                store: "remote",
                source: format!(
                    "asked for {} bytes, got {}",
                    range.end - range.start,
                    bytes.len()
                )
                .into(),
            }));
        }
        Ok(bytes)
    }
}

enum Attempt {
    Changed(Option<String>),
    Error(object_store::Error),
}

fn timeout_error(timeout: Duration) -> object_store::Error {
    object_store::Error::Generic {
        store: "remote",
        source: format!("no answer in {:.1} s", timeout.as_secs_f64()).into(),
    }
}

/// Whether an object_store error may pass: the answers that name a permanent state
/// are final; everything else (connection refused or reset, a timeout, a 5xx or 429, a
/// body cut short) is retried until the deadline. object_store does not expose the
/// status of its other errors (its `RetryError` is private), so a 4xx it does not map
/// is retried too: slower to fail, still within the deadline.
fn classify(error: &object_store::Error) -> Retry {
    use object_store::Error as E;
    match error {
        E::NotFound { .. }
        | E::Precondition { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::NotSupported { .. }
        | E::InvalidPath { .. }
        | E::NotImplemented { .. } => Retry::Permanent,
        _ => Retry::Transient,
    }
}

fn store_path(key: &str) -> StorePath {
    StorePath::parse(key).unwrap_or_else(|_| StorePath::from(key))
}

/// The current profile's settings in the AWS shared files (empty when there are none).
fn aws_file_settings() -> hyperoffload::remote::aws_config::Settings {
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    let file = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(std::path::PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(default)))
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".to_string());
    hyperoffload::remote::aws_config::profile_settings(
        &profile,
        &file("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
        &file("AWS_CONFIG_FILE", "config"),
    )
}
