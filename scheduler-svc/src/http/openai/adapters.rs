//! The served models and their LoRA adapters: `GET /v1/models` lists the base model and every
//! adapter (with `parent`, as vLLM does); `POST /v1/load_lora_adapter` and
//! `POST /v1/unload_lora_adapter` add and remove adapters at run time (vLLM's endpoints, behind
//! the API keys as the rest of the API).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::front::adapters::AdapterError;
use crate::front::GenerationService;
use crate::http::ApiError;

/// `GET /v1/models`: each base model, then its adapters.
pub async fn models(State(front): State<GenerationService>) -> Response {
    let mut data = Vec::new();
    for m in front.models().iter() {
        // `architecture` and `weight_types` are Ferry's: what the file is and that it is served.
        data.push(json!({
            "id": m.name(), "object": "model", "created": 0, "owned_by": "ferry",
            "root": m.name(), "parent": null,
            "max_model_len": m.max_model_len, "architecture": m.file.shape.family.name,
            "weight_types": m.file.weight_types,
        }));
        for (name, a) in m.adapters.list() {
            let modules: Vec<&str> = a.modules.iter().map(|m| m.peft_name()).collect();
            data.push(json!({
                "id": name, "object": "model", "created": 0, "owned_by": "ferry",
                "root": a.path, "parent": m.name(), "max_model_len": m.max_model_len,
                "lora_rank": a.rank, "lora_target_modules": modules,
            }));
        }
    }
    let body = json!({ "object": "list", "data": data });
    ([("content-type", "application/json")], body.to_string()).into_response()
}

/// `POST /v1/load_lora_adapter`'s body (vLLM's).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadBody {
    lora_name: String,
    lora_path: String,
    /// The base model it is for (Ferry's, as `--lora-modules`' JSON form; default: the first
    /// model served).
    #[serde(default)]
    base_model_name: Option<String>,
    /// Replace an adapter already served under the name.
    #[serde(default)]
    load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter`'s body (vLLM's; `lora_int_id` is not Ferry's and refused).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadBody {
    lora_name: String,
}

fn body<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not what it takes: {e}")))
}

/// A front in its own process does not change its adapters at run time: the schedulers it
/// sends requests to would not learn of it (they resolve a request's adapter by name), so an
/// adapter loaded here would be a 404 there.
fn local_only(front: &GenerationService) -> Result<(), ApiError> {
    if !front.is_remote() {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "this front sends requests to the schedulers, which would not serve an adapter loaded \
         here: start every front and scheduler with the adapter in --lora-modules (run-time \
         loading works on `ferry serve` and on a scheduler's own API)"
            .to_string(),
    ))
}

fn refused(e: &AdapterError) -> ApiError {
    let status = match e {
        AdapterError::Unknown(_) => StatusCode::NOT_FOUND,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, e.to_string())
}

/// `POST /v1/load_lora_adapter`: checks the adapter fits the model, then serves it.
pub async fn load_lora_adapter(
    State(front): State<GenerationService>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    local_only(&front)?;
    let b: LoadBody = body(&bytes)?;
    let (name, path) = (b.lora_name.clone(), b.lora_path.clone());
    // Reading an adapter is file I/O and a few MB of parsing: off the async threads.
    let result = tokio::task::spawn_blocking(move || {
        let models = front.models();
        if b.load_inplace && models.iter().any(|m| m.adapters.contains(&b.lora_name)) {
            models.unload_adapter(&b.lora_name)?;
        }
        models.load_adapter(b.base_model_name.as_deref(), &b.lora_name, &b.lora_path)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let entry = result.map_err(|e| refused(&e))?;
    tracing::info!(adapter = %name, %path, rank = entry.rank, "LoRA adapter loaded over HTTP");
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// `POST /v1/unload_lora_adapter`: stops serving an adapter (requests running with it
/// finish with it).
pub async fn unload_lora_adapter(
    State(front): State<GenerationService>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    local_only(&front)?;
    let b: UnloadBody = body(&bytes)?;
    front.models().unload_adapter(&b.lora_name).map_err(|e| refused(&e))?;
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", b.lora_name).into_response())
}
