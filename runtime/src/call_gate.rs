//! A gate in front of every call on an API port: a check of the call's headers (an API key)
//! that every path must pass but those left open (a service that checks its callers itself,
//! health for probes). A refused call is answered with the check's status — gRPC's trailers in
//! the response headers, which an HTTP/1.1 client reads as the same status — and reaches no
//! service.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::Either;
use tonic::codegen::{http, Service};

/// Checks a call's headers: `Err` is the status it is refused with.
pub type Check = Arc<dyn Fn(&http::HeaderMap) -> Result<(), tonic::Status> + Send + Sync>;

/// The gate: with no check, every call passes.
#[derive(Clone, Default)]
pub struct CallGate {
    check: Option<Check>,
    /// Path prefixes that pass unchecked.
    open: Vec<String>,
}

impl CallGate {
    /// A gate that refuses any call `check` refuses, but on paths starting with one of `open`.
    pub fn new(check: Check, open: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self { check: Some(check), open: open.into_iter().map(Into::into).collect() }
    }

    /// The status `path` with `headers` is refused with, if it is.
    fn refusal(&self, path: &str, headers: &http::HeaderMap) -> Option<tonic::Status> {
        let check = self.check.as_ref()?;
        if self.open.iter().any(|p| path.starts_with(p.as_str())) {
            return None;
        }
        check(headers).err()
    }
}

impl<S> tower::Layer<S> for CallGate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Gated<S> {
        Gated { inner, gate: self.clone() }
    }
}

/// A service behind a [`CallGate`].
#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    gate: CallGate,
}

impl<S, B> Service<http::Request<B>> for Gated<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<Self::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match self.gate.refusal(request.uri().path(), request.headers()) {
            Some(status) => Either::Left(std::future::ready(Ok(status.into_http()))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> CallGate {
        let check: Check = Arc::new(|h: &http::HeaderMap| match h.get("authorization") {
            Some(v) if v == "Bearer k" => Ok(()),
            _ => Err(tonic::Status::unauthenticated("no key")),
        });
        CallGate::new(check, ["/open.Service/"])
    }

    #[test]
    fn only_open_paths_pass_without_the_check() {
        let g = gate();
        let none = http::HeaderMap::new();
        let mut keyed = http::HeaderMap::new();
        keyed.insert("authorization", http::HeaderValue::from_static("Bearer k"));
        assert!(g.refusal("/open.Service/Call", &none).is_none());
        let refused = g.refusal("/closed.Service/Call", &none).expect("refused");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(g.refusal("/closed.Service/Call", &keyed).is_none());
        assert!(CallGate::default().refusal("/closed.Service/Call", &none).is_none());
    }
}
