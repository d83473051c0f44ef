//! Applying a validated step's request diffs, in the order the step lists them: the finished
//! requests are forgotten, the preempted marked, the new ones added (with the parts validation
//! prepared for them), the updated ones given their new blocks (or, resumed, their new table).
//! Nothing here can fail: [`super::validate`] has checked all of it.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_model::lora::LoraAdapter;
use ferry_proto::v1;

use super::trace::RequestTrace;
use super::validate::{NewParts, Prepared};
use super::{Engine, ExecRequest};
use crate::engine::looped::LoopState;

impl Engine {
    /// Applies the request diffs of a validated step; `prepared` holds its new requests'
    /// parts, `adapters` their LoRA adapters.
    pub(super) fn apply_diff(
        &mut self,
        step: &v1::Step,
        mut prepared: Prepared,
        adapters: &HashMap<u64, Arc<LoraAdapter>>,
    ) {
        for id in &step.finished_ids {
            if let Some(t) = self.requests.remove(id).and_then(|r| r.trace) {
                t.end("finished");
            }
        }
        for id in &step.preempted_ids {
            if let Some(r) = self.requests.get_mut(id) {
                r.preempted = true;
                // Its chain's hidden states go: the scheduler recomputes the chain.
                if let Some(l) = &mut r.looped {
                    l.chain = None;
                }
                if let Some(t) = &r.trace {
                    use opentelemetry::trace::TraceContextExt;
                    t.cx.span().add_event("preempted", Vec::new());
                }
            }
        }
        for nr in &step.new_requests {
            let NewParts { sampling, adjust, grammar } =
                prepared.remove(&nr.id).expect("validated: every new request is prepared");
            self.requests.insert(
                nr.id,
                ExecRequest {
                    prompt: nr.prompt_token_ids.clone(),
                    output: nr.output_token_ids.clone(),
                    sampling,
                    adjust,
                    table: nr.block_ids.clone(),
                    computed: nr.num_computed_tokens as usize,
                    preempted: false,
                    grammar,
                    trace: RequestTrace::start(&nr.traceparent, nr.id),
                    looped: (nr.max_loops > 0).then(|| LoopState {
                        max_loops: u8::try_from(nr.max_loops).unwrap_or(u8::MAX),
                        threshold: nr.sampling.as_ref().and_then(|s| s.exit_threshold),
                        chain: None,
                    }),
                    adapter: adapters.get(&nr.id).cloned(),
                },
            );
        }
        for cu in &step.cached_requests {
            let r = self.requests.get_mut(&cu.id).expect("validated: cached requests are live");
            if cu.resumed {
                r.table.clone_from(&cu.new_block_ids);
                r.preempted = false;
                r.computed = cu.num_computed_tokens as usize;
                if let Some(l) = &mut r.looped {
                    l.chain = None;
                }
            } else {
                r.table.extend_from_slice(&cu.new_block_ids);
            }
        }
    }
}
