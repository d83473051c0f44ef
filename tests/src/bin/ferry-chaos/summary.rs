//! The soak's outcome: every stream counted against its undisturbed run (completed, lost,
//! differing), the longest stall and first-token wait, the blocks left held; printed, and the
//! verdict the exit status follows.

use std::time::Instant;

use ferry_proto::v1;

use crate::load::Stream;

/// The soak's outcome.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    pub(crate) seconds: f64,
    pub(crate) faults: Vec<(String, usize)>,
    pub(crate) requests: usize,
    pub(crate) completed: usize,
    pub(crate) lost: usize,
    pub(crate) differing: usize,
    pub(crate) moved: u64,
    pub(crate) longest_stall_ms: u128,
    /// When (seconds into the soak) the longest stall began.
    pub(crate) longest_stall_at: f64,
    pub(crate) longest_first_token_ms: u128,
    pub(crate) leaked_blocks: u64,
    pub(crate) leaked_requests: u64,
}

impl Summary {
    pub(crate) fn ok(&self) -> bool {
        self.lost == 0
            && self.differing == 0
            && self.leaked_blocks == 0
            && self.leaked_requests == 0
    }

    pub(crate) fn print(&self, json: bool) {
        println!("chaos soak: {:.0} s", self.seconds);
        let faults: usize = self.faults.iter().map(|(_, n)| n).sum();
        println!("  faults: {faults}");
        for (label, n) in &self.faults {
            println!("    {n:>4}  {label}");
        }
        println!("  requests: {}", self.requests);
        println!("  completed: {}", self.completed);
        println!("  lost: {} (must be 0)", self.lost);
        println!("  differing from the undisturbed run: {} (must be 0)", self.differing);
        println!("  moved by the front: {}", self.moved);
        println!(
            "  longest stall between tokens: {} ms (from {:.1} s)",
            self.longest_stall_ms, self.longest_stall_at
        );
        println!("  longest wait for a first token: {} ms", self.longest_first_token_ms);
        println!(
            "  leaked: {} blocks, {} requests (must be 0)",
            self.leaked_blocks, self.leaked_requests
        );
        println!("  verdict: {}", if self.ok() { "PASS" } else { "FAIL" });
        if json {
            let faults: serde_json::Map<String, serde_json::Value> =
                self.faults.iter().map(|(l, n)| (l.clone(), (*n).into())).collect();
            let v = serde_json::json!({
                "seconds": self.seconds,
                "faults": faults,
                "requests": self.requests,
                "completed": self.completed,
                "lost": self.lost,
                "differing": self.differing,
                "moved": self.moved,
                "longest_stall_ms": self.longest_stall_ms,
                "longest_first_token_ms": self.longest_first_token_ms,
                "leaked_blocks": self.leaked_blocks,
                "leaked_requests": self.leaked_requests,
                "ok": self.ok(),
            });
            println!("{v}");
        }
    }
}

impl Summary {
    /// Counts stream `s` of request `k`, whose undisturbed run gave `reference`.
    pub(crate) fn count(
        &mut self,
        k: usize,
        s: &Stream,
        reference: &(Vec<u32>, String),
        started: Instant,
    ) {
        let summary = self;
        summary.requests += 1;
        let complete = s.finish == v1::FinishReason::Length as i32 && s.error.is_empty();
        if complete {
            summary.completed += 1;
            if (&s.tokens, &s.text) != (&reference.0, &reference.1) {
                summary.differing += 1;
            }
        } else {
            summary.lost += 1;
            eprintln!("ferry-chaos: lost request {k}: finish {} {}", s.finish, s.error);
        }
        if let (Some(sent), Some(first)) = (s.sent, s.arrived.first()) {
            summary.longest_first_token_ms =
                summary.longest_first_token_ms.max((*first - sent).as_millis());
        }
        for w in s.arrived.windows(2) {
            let gap = (w[1] - w[0]).as_millis();
            if gap > summary.longest_stall_ms {
                summary.longest_stall_ms = gap;
                summary.longest_stall_at = w[0].saturating_duration_since(started).as_secs_f64();
            }
        }
    }
}
