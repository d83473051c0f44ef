//! The OpenAI-compatible HTTP API (DESIGN.md §8): `/v1/completions`, `/v1/chat/completions`
//! (streaming SSE and not), `/v1/models`, `/health`. Each request is translated into the
//! front's own `Generate` call, so HTTP and gRPC clients take exactly the same path.
//!
//! Errors use OpenAI's JSON shape (`{"error": {"message", "type", "code"}}`) with the HTTP
//! status mapped from the front's gRPC code in one table ([`http_status`]).
//!
//! With API keys (`front/keys.rs`), every `/v1/` route needs `Authorization: Bearer <key>`
//! before its body is read (401 otherwise); `/health` and `/metrics` too when configured.

mod fields;
mod openai;

use std::future::Future;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

use crate::front::GenerationService;

/// The gRPC code → HTTP status table (linkerd's pairing).
pub fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code;
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// An error response in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    /// Seconds the client should wait (a rate limit says how long; 1 by default).
    retry_after: Option<String>,
}

impl ApiError {
    /// A `status` with `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), retry_after: None }
    }

    /// A 400 with `message`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), retry_after: None }
    }

    /// What the client is told.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        let retry_after =
            s.metadata().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
        Self { status: http_status(s.code()), message: s.message().to_string(), retry_after }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = serde_json::json!({
            "error": { "message": self.message, "type": kind, "code": self.status.as_u16() }
        });
        let mut response =
            (self.status, [("content-type", "application/json")], body.to_string()).into_response();
        let headers = response.headers_mut();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            // A full queue, a rate limit or a missing executor is temporary: say when to come
            // back.
            let after = self.retry_after.as_deref().and_then(|a| a.parse().ok());
            let after = after.unwrap_or(axum::http::HeaderValue::from_static("1"));
            headers.insert("retry-after", after);
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The routes, over `front`, with `/metrics` rendering `metrics`.
pub fn router(
    front: GenerationService,
    metrics: std::sync::Arc<dyn ferry_runtime::prometheus::Render>,
) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/load_lora_adapter", post(openai::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(openai::unload_lora_adapter))
        .route_layer(middleware::from_fn_with_state(front.clone(), require_key))
        .layer(DefaultBodyLimit::max(front.limits().max_request_bytes))
        .with_state(front.clone());
    let mut open = Router::new()
        .route("/health", get(health))
        .with_state(front.clone())
        .merge(ferry_runtime::prometheus::router(metrics));
    if front.keys().is_some_and(|k| k.guard_health_and_metrics) {
        open = open.route_layer(middleware::from_fn_with_state(front, require_key));
    }
    api.merge(open).fallback(not_served).method_not_allowed_fallback(not_allowed)
}

/// The routes this API serves, for the answer to any other.
const ROUTES: &str = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, \
                      POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health and \
                      GET /metrics";

/// A 404 in OpenAI's shape (an OpenAI client shows its message) for a route not served.
async fn not_served(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("{method} {} is not served here; this API serves {ROUTES}", uri.path()),
        retry_after: None,
    }
}

/// A 405 in OpenAI's shape for a served route asked with another method.
async fn not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{method} is not allowed on {}; this API serves {ROUTES}", uri.path()),
        retry_after: None,
    }
}

/// Lets a request through only with a valid API key (when keys are configured): 401 in
/// OpenAI's shape otherwise, before its body is read.
async fn require_key(
    State(front): State<GenerationService>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(keys) = front.keys() {
        if let Err(status) = keys.identify_headers(request.headers()) {
            return ApiError::from(status).into_response();
        }
    }
    next.run(request).await
}

async fn health(State(front): State<GenerationService>) -> Response {
    if front.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else if let Some(notice) = front.standby_notice() {
        (StatusCode::SERVICE_UNAVAILABLE, notice).into_response()
    } else if front.has_executors() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no executor is connected").into_response()
    }
}

/// Serves the HTTP API on `listener` until `shutdown` resolves.
pub async fn serve(
    front: GenerationService,
    metrics: std::sync::Arc<dyn ferry_runtime::prometheus::Render>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router(front, metrics);
    match ferry_runtime::tls::current() {
        Some(tls) => {
            // The API authenticates callers by key: server TLS, no client certificate.
            let listener = ferry_runtime::tls::Listener::new(
                tls,
                listener,
                ferry_runtime::tls::Callers::Anyone,
            )?;
            axum::serve(listener, router).with_graceful_shutdown(shutdown).await
        }
        None => axum::serve(no_delay(listener), router).with_graceful_shutdown(shutdown).await,
    }
}

/// `listener` with `TCP_NODELAY` on every connection it accepts, so each streamed token goes out
/// when written: with Nagle's algorithm a token would wait for the client's
/// acknowledgement of the one before, up to its delayed-ACK timer (40 ms on Linux). (The TLS
/// listener sets it too.)
fn no_delay(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an HTTP connection");
        }
    })
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    #[tokio::test]
    async fn the_plaintext_api_listener_turns_nagle_off_on_every_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = super::no_delay(listener);
        for _ in 0..2 {
            let client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (accepted, _) = listener.accept().await;
            assert!(accepted.nodelay().unwrap(), "an accepted connection kept Nagle on");
            drop(client);
        }
    }
}
