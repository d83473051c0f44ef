//! API keys on the front (issue 18): who may call the client APIs, and how much.
//!
//! Keys come from `--api-key` (one key, id `default`, no limits; vLLM's flag) and from
//! `--api-keys-file` (several keys, each with an id and its own limits). A caller presents its
//! key as `Authorization: Bearer <key>` (HTTP header or gRPC metadata). It is compared with every
//! configured key in constant time; from then on only the key's id is named — in logs, metrics
//! and traces — never the key.
//!
//! Limits, per key, as OpenAI applies them: requests per minute and tokens per minute (token
//! buckets that refill continuously, holding at most one minute's worth), and requests at once.
//! A request's tokens are charged when it is admitted as its prompt plus its `max_tokens`, as
//! OpenAI estimates them. Over a limit is 429 with a `Retry-After` that says when the bucket
//! holds enough again; a request that needs more tokens than the key may use in a minute can
//! never pass and is a 400 that says so.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_runtime::prometheus::{Counter, Render, Text};
use serde::Deserialize;
use tonic::metadata::MetadataMap;
use tonic::Status;

/// The metadata (and HTTP header) a key travels in.
pub const AUTHORIZATION: &str = "authorization";

/// The limits of one key (`None`: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt + `max_tokens`) admitted per minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests running at once.
    pub max_concurrent: Option<u32>,
}

/// Which limit refused a request (the label of `ferry_api_key_refused`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
    /// Requests at once.
    Concurrent,
}

impl Limit {
    /// Every limit, in label order.
    pub const ALL: [Limit; 3] = [Limit::Requests, Limit::Tokens, Limit::Concurrent];

    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Limit::Requests => "requests_per_minute",
            Limit::Tokens => "tokens_per_minute",
            Limit::Concurrent => "max_concurrent",
        }
    }
}

/// A per-minute allowance that refills continuously and holds at most one minute's worth.
#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: f64, now: Instant) -> Self {
        Self { per_minute, level: per_minute, at: now }
    }

    fn refill(&mut self, now: Instant) {
        let minutes = now.saturating_duration_since(self.at).as_secs_f64() / 60.0;
        self.level = (self.level + minutes * self.per_minute).min(self.per_minute);
        self.at = now;
    }

    /// Seconds until it holds `cost` (0 when it does now).
    fn wait_for(&self, cost: f64) -> u64 {
        let missing = (cost - self.level).max(0.0);
        (missing / self.per_minute * 60.0).ceil() as u64
    }
}

/// What a key has used.
#[derive(Debug)]
struct Usage {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    running: u32,
}

/// One configured key.
pub struct ApiKey {
    /// Its id: what logs, metrics and traces name.
    pub id: Arc<str>,
    secret: Box<[u8]>,
    limits: Limits,
    usage: Mutex<Usage>,
    /// Requests it had admitted.
    pub admitted: Counter,
    /// Tokens charged to it.
    pub tokens: Counter,
    /// Requests refused by each of [`Limit::ALL`].
    pub refused: [Counter; 3],
}

/// Names the key by its id only: the secret never reaches a log line.
impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("id", &self.id)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// A request admitted under a key: it counts as running until dropped.
#[derive(Debug)]
pub struct Permit {
    key: Arc<ApiKey>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Ok(mut usage) = self.key.usage.lock() {
            usage.running = usage.running.saturating_sub(1);
        }
    }
}

impl ApiKey {
    fn new(id: &str, secret: &str, limits: Limits, now: Instant) -> Self {
        let bucket = |per_minute: Option<f64>| per_minute.map(|p| Bucket::new(p, now));
        Self {
            id: id.into(),
            secret: secret.as_bytes().into(),
            limits,
            usage: Mutex::new(Usage {
                requests: bucket(limits.requests_per_minute.map(f64::from)),
                tokens: bucket(limits.tokens_per_minute.map(|t| t as f64)),
                running: 0,
            }),
            admitted: Counter::default(),
            tokens: Counter::default(),
            refused: Default::default(),
        }
    }

    /// Requests running under this key now.
    pub fn running(&self) -> u32 {
        self.usage.lock().map_or(0, |u| u.running)
    }

    /// Admits a request that needs `tokens` (prompt + `max_tokens`) at `now`, or says which
    /// limit refuses it: `RESOURCE_EXHAUSTED` with `retry-after` (seconds) in its metadata, or
    /// `INVALID_ARGUMENT` when the request needs more tokens than the key may use in a minute.
    pub fn admit(self: &Arc<Self>, tokens: u64, now: Instant) -> Result<Permit, Status> {
        let mut usage = self.usage.lock().map_err(|_| Status::internal("key state is poisoned"))?;
        let usage = &mut *usage;
        if let Some(max) = self.limits.tokens_per_minute.filter(|max| tokens > *max) {
            return Err(Status::invalid_argument(format!(
                "the request needs {tokens} tokens (prompt + max_tokens), more than API key \
                 {:?} may use in a minute ({max}); lower max_tokens or shorten the prompt",
                self.id
            )));
        }
        let refuse = |limit: Limit, retry: u64, why: String| {
            self.refused[limit as usize].add(1);
            let mut status = Status::resource_exhausted(why);
            if let Ok(v) = retry.max(1).to_string().parse() {
                status.metadata_mut().insert("retry-after", v);
            }
            Err(status)
        };
        if let Some(max) = self.limits.max_concurrent.filter(|max| usage.running >= *max) {
            return refuse(
                Limit::Concurrent,
                1,
                format!(
                    "API key {:?} has {max} requests running, its limit; retry when one ends",
                    self.id
                ),
            );
        }
        if let Some(b) = &mut usage.requests {
            b.refill(now);
            if b.level < 1.0 {
                let wait = b.wait_for(1.0);
                let why = format!(
                    "API key {:?} is over its limit of {} requests per minute; retry in {wait} s",
                    self.id, b.per_minute
                );
                return refuse(Limit::Requests, wait, why);
            }
        }
        if let Some(b) = &mut usage.tokens {
            b.refill(now);
            if b.level < tokens as f64 {
                let wait = b.wait_for(tokens as f64);
                let why = format!(
                    "API key {:?} is over its limit of {} tokens per minute (this request needs \
                     {tokens}: prompt + max_tokens); retry in {wait} s",
                    self.id, b.per_minute
                );
                return refuse(Limit::Tokens, wait, why);
            }
        }
        if let Some(b) = &mut usage.requests {
            b.level -= 1.0;
        }
        if let Some(b) = &mut usage.tokens {
            b.level -= tokens as f64;
        }
        usage.running += 1;
        self.admitted.add(1);
        self.tokens.add(tokens);
        Ok(Permit { key: self.clone() })
    }
}

/// One key as `--api-keys-file` lists it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKey {
    id: String,
    key: String,
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
    max_concurrent: Option<u32>,
}

/// `--api-keys-file`'s shape: `{"keys": [{"id", "key", limits…}]}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    keys: Vec<FileKey>,
}

/// The configured keys.
#[derive(Debug)]
pub struct ApiKeys {
    keys: Vec<Arc<ApiKey>>,
    /// Whether `/health` and `/metrics` on the HTTP API need a key too.
    pub guard_health_and_metrics: bool,
    /// Calls refused for want of a valid key.
    pub unauthenticated: Counter,
}

impl ApiKeys {
    /// The keys from `--api-key` (`single`) and `--api-keys-file` (`file`); `None` when neither
    /// is given (the APIs are open). Every problem names the flag and what is wrong.
    pub fn load(
        single: Option<&str>,
        file: Option<&Path>,
        guard_health_and_metrics: bool,
    ) -> Result<Option<Self>, String> {
        let now = Instant::now();
        let mut keys: Vec<Arc<ApiKey>> = Vec::new();
        if let Some(key) = single {
            check_key(key).map_err(|why| format!("--api-key: {why}"))?;
            keys.push(Arc::new(ApiKey::new("default", key, Limits::default(), now)));
        }
        if let Some(path) = file {
            let flag = format!("--api-keys-file {}", path.display());
            let text = std::fs::read_to_string(path).map_err(|e| format!("{flag}: {e}"))?;
            let parsed: KeysFile = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "{flag}: {e} (expected {{\"keys\": [{{\"id\": \"team-a\", \"key\": \"…\", \
                     \"requests_per_minute\": 60, \"tokens_per_minute\": 100000, \
                     \"max_concurrent\": 8}}]}}, the limits optional)"
                )
            })?;
            if parsed.keys.is_empty() {
                return Err(format!("{flag}: lists no key"));
            }
            for k in parsed.keys {
                let at = format!("{flag}: key {:?}", k.id);
                check_id(&k.id).map_err(|why| format!("{at}: {why}"))?;
                check_key(&k.key).map_err(|why| format!("{at}: {why}"))?;
                let l = Limits {
                    requests_per_minute: k.requests_per_minute,
                    tokens_per_minute: k.tokens_per_minute,
                    max_concurrent: k.max_concurrent,
                };
                if l.requests_per_minute == Some(0)
                    || l.tokens_per_minute == Some(0)
                    || l.max_concurrent == Some(0)
                {
                    return Err(format!("{at}: a limit must be at least 1 (omit it for none)"));
                }
                if keys.iter().any(|o| *o.id == *k.id) {
                    return Err(format!("{at}: the id is used twice"));
                }
                if keys.iter().any(|o| *o.secret == *k.key.as_bytes()) {
                    return Err(format!("{at}: the same key is listed twice"));
                }
                keys.push(Arc::new(ApiKey::new(&k.id, &k.key, l, now)));
            }
        }
        if keys.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self { keys, guard_health_and_metrics, unauthenticated: Counter::default() }))
    }

    /// The configured keys.
    pub fn keys(&self) -> &[Arc<ApiKey>] {
        &self.keys
    }

    /// The key `authorization` (`Bearer <key>`) presents, or `UNAUTHENTICATED`.
    pub fn identify(&self, authorization: Option<&str>) -> Result<Arc<ApiKey>, Status> {
        let presented = authorization.and_then(|a| {
            let (scheme, key) = a.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        });
        let Some(presented) = presented else {
            self.unauthenticated.add(1);
            return Err(Status::unauthenticated(
                "an API key is required: send the header `Authorization: Bearer <key>`",
            ));
        };
        // Every key is compared (no early exit), each in constant time.
        let found = self.keys.iter().fold(None, |found, k| {
            let same = ferry_runtime::secret::same(&k.secret, presented.as_bytes());
            if same {
                Some(k.clone())
            } else {
                found
            }
        });
        found.ok_or_else(|| {
            self.unauthenticated.add(1);
            Status::unauthenticated("the API key is not valid")
        })
    }

    /// [`Self::identify`] from gRPC metadata (its HTTP headers).
    pub fn identify_call(&self, metadata: &MetadataMap) -> Result<Arc<ApiKey>, Status> {
        self.identify_headers(metadata.as_ref())
    }

    /// [`Self::identify`] from HTTP headers (the OpenAI API, and any call on the gRPC port).
    pub fn identify_headers(&self, headers: &axum::http::HeaderMap) -> Result<Arc<ApiKey>, Status> {
        self.identify(headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()))
    }
}

fn check_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() || key.len() > 1024 {
        return Err("a key must be 1 to 1024 characters");
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a key must be printable ASCII without spaces");
    }
    Ok(())
}

fn check_id(id: &str) -> Result<(), &'static str> {
    let ok = (1..=64).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err("an id must be 1 to 64 letters, digits, `-`, `_` or `.`")
    }
}

/// The keys' counters for `/metrics`, labelled with each key's id (never the key) and the
/// served model.
pub struct KeyMetrics {
    /// The served model (every series' `model_name`).
    pub model_name: String,
    /// The keys.
    pub keys: Arc<ApiKeys>,
}

impl Render for KeyMetrics {
    fn render(&self, t: &mut Text) {
        type Pick = fn(&ApiKey) -> f64;
        let m = [("model_name", self.model_name.as_str())];
        let keys = &self.keys;
        t.counter(
            "ferry_api_unauthenticated",
            "Calls refused for want of a valid API key.",
            &m,
            keys.unauthenticated.get() as f64,
        );
        let per_key: [(&str, &str, &str, Pick); 3] = [
            ("ferry_api_key_requests", "counter", "Requests admitted, by API key id.", |k| {
                k.admitted.get() as f64
            }),
            (
                "ferry_api_key_tokens",
                "counter",
                "Tokens charged (prompt + max_tokens), by API key id.",
                |k| k.tokens.get() as f64,
            ),
            ("ferry_api_key_running", "gauge", "Requests running, by API key id.", |k| {
                f64::from(k.running())
            }),
        ];
        for (name, kind, help, pick) in per_key {
            t.family(name, kind, help);
            for k in keys.keys() {
                t.sample(name, &[m[0], ("api_key", &k.id)], pick(k));
            }
        }
        let name = "ferry_api_key_refused";
        t.family(name, "counter", "Requests refused over a limit, by API key id and limit.");
        for k in keys.keys() {
            for limit in Limit::ALL {
                let labels = [m[0], ("api_key", &*k.id), ("limit", limit.label())];
                t.sample(name, &labels, k.refused[limit as usize].get() as f64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{ApiKey, ApiKeys, Limits};

    fn key(limits: Limits) -> std::sync::Arc<ApiKey> {
        std::sync::Arc::new(ApiKey::new("k", "secret-k", limits, Instant::now()))
    }

    /// The refusal of `tokens` at `at` by a limit, and its `retry-after` seconds.
    fn limited(k: &std::sync::Arc<ApiKey>, tokens: u64, at: Instant) -> (tonic::Status, u64) {
        let refused = k.admit(tokens, at).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        let retry = refused.metadata().get("retry-after").unwrap().to_str().unwrap();
        let retry = retry.parse().unwrap();
        (refused, retry)
    }

    #[test]
    fn requests_per_minute_refill_continuously() {
        let k = key(Limits { requests_per_minute: Some(2), ..Limits::default() });
        let t0 = Instant::now();
        let (a, b) = (k.admit(1, t0).unwrap(), k.admit(1, t0).unwrap());
        assert_eq!(limited(&k, 1, t0).1, 30, "a request every 30 s");
        assert!(k.admit(1, t0 + Duration::from_secs(29)).is_err());
        assert!(k.admit(1, t0 + Duration::from_secs(30)).is_ok());
        assert_eq!(k.refused[0].get(), 2);
        drop((a, b));
        assert_eq!(k.running(), 0, "every permit ended");
    }

    #[test]
    fn tokens_per_minute_charge_prompt_plus_max_tokens() {
        let k = key(Limits { tokens_per_minute: Some(600), ..Limits::default() });
        let t0 = Instant::now();
        let _a = k.admit(500, t0).unwrap();
        assert_eq!(limited(&k, 200, t0).1, 10, "100 missing at 10 a second");
        assert!(k.admit(200, t0 + Duration::from_secs(10)).is_ok());
        // More than a minute's worth can never pass: not a rate limit but a bad request.
        let too_big = k.admit(601, t0 + Duration::from_mins(10)).unwrap_err();
        assert_eq!(too_big.code(), tonic::Code::InvalidArgument);
        assert!(too_big.message().contains("(600)"), "{}", too_big.message());
        assert_eq!(k.tokens.get(), 700);
    }

    #[test]
    fn concurrency_is_held_by_permits() {
        let k = key(Limits { max_concurrent: Some(1), ..Limits::default() });
        let now = Instant::now();
        let permit = k.admit(1, now).unwrap();
        let (refused, _) = limited(&k, 1, now);
        assert!(refused.message().contains("1 requests running"), "{}", refused.message());
        drop(permit);
        assert!(k.admit(1, now).is_ok());
    }

    #[test]
    fn keys_are_identified_by_bearer_only_and_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("ferry-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.json");
        let write = |text: &str| std::fs::write(&file, text).unwrap();
        write(r#"{"keys": [{"id": "team-a", "key": "sk-a-123", "max_concurrent": 2}]}"#);
        let keys = ApiKeys::load(Some("sk-default"), Some(&file), false).unwrap().unwrap();
        assert_eq!(&*keys.identify(Some("Bearer sk-a-123")).unwrap().id, "team-a");
        assert_eq!(&*keys.identify(Some("bearer  sk-default ")).unwrap().id, "default");
        for bad in [None, Some("sk-a-123"), Some("Basic sk-a-123"), Some("Bearer sk-a-12")] {
            let e = keys.identify(bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
            assert!(!e.message().contains("sk-"), "a refusal names no key: {e:?}");
        }
        assert_eq!(keys.unauthenticated.get(), 4);
        assert!(ApiKeys::load(None, None, false).unwrap().is_none(), "no key: open");

        let refused = |text: &str| {
            write(text);
            ApiKeys::load(None, Some(&file), false).unwrap_err()
        };
        assert!(refused(r#"{"keys": []}"#).contains("lists no key"));
        assert!(refused(r#"{"keys": [{"id": "a b", "key": "k"}]}"#).contains("an id must be"));
        assert!(refused(r#"{"keys": [{"id": "a", "key": "has space"}]}"#).contains("printable"));
        let twice = r#"{"keys": [{"id": "a", "key": "k1"}, {"id": "a", "key": "k2"}]}"#;
        assert!(refused(twice).contains("used twice"));
        let zero = r#"{"keys": [{"id": "a", "key": "k1", "tokens_per_minute": 0}]}"#;
        assert!(refused(zero).contains("at least 1"));
        let typo = refused(r#"{"keys": [{"id": "a", "key": "k1", "rpm": 5}]}"#);
        assert!(typo.contains("rpm") && typo.contains("expected"), "{typo}");
        assert!(ApiKeys::load(Some(""), None, false).unwrap_err().contains("--api-key"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
