//! The OpenAI-compatible HTTP API (DESIGN.md §8): `/v1/completions`, `/v1/chat/completions`
//! (streaming SSE and not), `/v1/models`, `/health`. Each request is translated into the
//! front's own `Generate` call, so HTTP and gRPC clients take exactly the same path.
//!
//! Errors use OpenAI's JSON shape (`{"error": {"message", "type", "code"}}`) with the HTTP
//! status mapped from the front's gRPC code in one table ([`http_status`]).

mod openai;

use std::future::Future;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

use crate::front::GenerationService;

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

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
}

impl ApiError {
    /// A 400 with `message`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into() }
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        Self { status: http_status(s.code()), message: s.message().to_string() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = serde_json::json!({
            "error": { "message": self.message, "type": kind, "code": self.status.as_u16() }
        });
        let mut response =
            (self.status, [("content-type", "application/json")], body.to_string()).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            // A full queue or a missing executor is temporary: say when to come back.
            response.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

/// The routes, over `front`.
pub fn router(front: GenerationService) -> Router {
    Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/health", get(health))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(front)
}

async fn health(State(front): State<GenerationService>) -> Response {
    if front.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else if front.has_executors() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no executor is connected").into_response()
    }
}

/// Serves the HTTP API on `listener` until `shutdown` resolves.
pub async fn serve(
    front: GenerationService,
    metrics: std::sync::Arc<dyn ferry_runtime::metrics::Render>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(front).merge(ferry_runtime::metrics::router(metrics));
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
