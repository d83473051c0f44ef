//! The router: where a new request goes — whole on a decode-capable executor (by the
//! configured [`Router`]), split between a prefill and a decode executor as the front's
//! disaggregation policy decides, or whole with a read of its prefix from the KV tier — and
//! its arrival there.
//!
//! The decisions are the front's own pure functions ([`ferry_sched_core::routing`]), so the
//! simulated router places requests as the real one does.

use ferry_sched_core::routing::{self, Candidate};
use ferry_sched_core::{extend_block_hashes, KvImport, NewRequest, RequestId, Timestamp};

use crate::workload::SimRequest;

use super::cluster_spec::Router;
use super::{Handoff, Sim, Track};

/// Where a new request goes.
enum Placement {
    Whole(usize),
    /// Whole on an executor, reading `tokens` of the prompt from agent `agent`'s store.
    TierRead {
        executor: usize,
        agent: usize,
        tokens: usize,
    },
    Split {
        prefill: usize,
        decode: usize,
        import_tokens: usize,
    },
}

impl Sim<'_> {
    /// Where the router places a request of `prompt` for `model`: among that model's
    /// executors (the front routes by `model` first), as the front does — split between a
    /// prefill and a decode executor when that pays, else whole on a decode-capable executor.
    fn place(&mut self, prompt: &[u32], model: usize) -> Placement {
        let spec = self.spec;
        let bs = spec.scheduler.block_size;
        let executors = self.pool_executors[model].clone();
        let decoders = if model == 0 { spec.prefill_executors..executors.end } else { executors };
        if spec.router == Router::KvAware || spec.prefill_executors > 0 || spec.kv_tier.is_some() {
            // Hashed once, looked up in every cache; never the block of the last token.
            let whole = prompt.len().saturating_sub(1) / bs * bs;
            self.hashes.clear();
            extend_block_hashes(&mut self.hashes, &prompt[..whole], bs, 0);
        }
        let rr = self.next_rr;
        if spec.router == Router::RoundRobin {
            self.next_rr += 1;
        }
        // `routing::pick` over `range` of the executors, by cached prefix when `by_prefix`.
        let pick = |range: std::ops::Range<usize>, by_prefix: bool| {
            let candidates = range.clone().map(|e| self.candidate(e, by_prefix));
            range.start + routing::pick(candidates, spec.route_load_tokens).unwrap_or(0)
        };
        let decode = match spec.router {
            Router::RoundRobin => decoders.start + rr % decoders.len(),
            Router::LeastLoad if spec.shards > 1 => self.pick_across_shards(false),
            Router::KvAware if spec.shards > 1 => self.pick_across_shards(true),
            Router::LeastLoad => pick(decoders.clone(), false),
            Router::KvAware => pick(decoders.clone(), true),
        };
        if spec.prefill_executors == 0 {
            return self.tier_read(decode, prompt.len());
        }
        let d = &self.execs[decode];
        let room =
            routing::has_room(spec.scheduler.num_blocks, d.core.stats().kv_usage, bs, prompt.len());
        let cached = self.candidate(decode, true).prefix_hit_tokens;
        if !room
            || !routing::worth_disaggregating(
                prompt.len(),
                cached,
                spec.disaggregation_min_tokens,
                bs,
            )
        {
            return self.tier_read(decode, prompt.len());
        }
        let prefill = pick(0..spec.prefill_executors, false); // the least loaded
        let import_tokens = routing::import_tokens(prompt.len(), bs);
        Placement::Split { prefill, decode, import_tokens }
    }

    /// What the router knows of executor `e` for the prompt hashed in `self.hashes`: its cached
    /// prefix of it (none counted unless `by_prefix`) and its live requests.
    fn candidate(&self, e: usize, by_prefix: bool) -> Candidate {
        let x = &self.execs[e];
        let bs = self.spec.scheduler.block_size;
        let hit = if by_prefix { x.core.cached_prefix_blocks(&self.hashes) * bs } else { 0 };
        Candidate { holds_adapter: false, prefix_hit_tokens: hit, load: x.live }
    }

    /// The fronts' cross-shard router: each shard answers with the candidate its router would
    /// pick ([`routing::best`], `Generation/Locate`), the request goes to the shard with the
    /// best answer ([`routing::pick`], shards in order), then to that executor.
    fn pick_across_shards(&self, by_prefix: bool) -> usize {
        let load_tokens = self.spec.route_load_tokens;
        let weigh = |e: usize| self.candidate(e, by_prefix);
        let members = |s: usize| (0..self.execs.len()).filter(move |&e| self.shard_of[e] == s);
        let answers: Vec<(usize, Candidate)> = (0..self.spec.shards)
            .filter_map(|s| Some((s, routing::best(members(s).map(weigh), load_tokens)?)))
            .collect();
        let shard =
            routing::pick(answers.iter().map(|(_, c)| *c), load_tokens).map_or(0, |k| answers[k].0);
        let within: Vec<usize> = members(shard).collect();
        within[routing::pick(within.iter().map(|&e| weigh(e)), load_tokens).unwrap_or(0)]
    }

    /// A request placed whole on executor `e`: with a KV tier, a read of its prompt's prefix
    /// from the agent holding the longest run of it (`e`'s own node first among equals), as
    /// the front's `tier_read` decides, when that covers `min_tokens` more than `e` caches.
    fn tier_read(&self, e: usize, prompt_len: usize) -> Placement {
        let Some(tier) = self.spec.kv_tier else { return Placement::Whole(e) };
        let bs = self.spec.scheduler.block_size;
        let covered = routing::import_tokens(prompt_len, bs) / bs;
        let hashes = &self.hashes[..covered.min(self.hashes.len())];
        let cached = self.execs[e].core.cached_prefix_blocks(hashes) * bs;
        let (agent, blocks) = self
            .agents
            .iter()
            .enumerate()
            .map(|(a, store)| (a, store.run(hashes)))
            .max_by_key(|&(a, blocks)| (blocks, a == e, std::cmp::Reverse(a)))
            .unwrap_or((e, 0));
        let tokens = blocks * bs;
        if tokens == 0 || tokens < cached + tier.min_tokens {
            return Placement::Whole(e);
        }
        Placement::TierRead { executor: e, agent, tokens }
    }

    pub(super) fn arrive(&mut self, r: &SimRequest) -> Result<(), String> {
        self.arrived += 1;
        self.first_arrival.get_or_insert(self.now);
        let id = r.index + 1;
        let mut req = NewRequest::new(
            RequestId(id),
            r.prompt.clone(),
            r.output_len as usize,
            Timestamp(self.now),
        );
        req.ignore_eos = true;
        let model = self.model_for(r.conversation.map_or(r.index, u64::from));
        self.by_model[model].requests += 1;
        let (e, handoff) = match self.place(&r.prompt, model) {
            Placement::Whole(e) => (e, None),
            Placement::TierRead { executor, agent, tokens } => {
                let hashes = self.hashes[..tokens / self.spec.scheduler.block_size].to_vec();
                let transfer = self.new_transfer(agent, executor, Some(hashes));
                req.kv_import = Some(KvImport { transfer_id: transfer, num_tokens: tokens });
                self.tier_reads += 1;
                self.tier_read_tokens += tokens as u64;
                (executor, None)
            }
            Placement::Split { prefill, decode, import_tokens } => {
                // Known from now on, so the bytes' arrival wakes the decode executor even if
                // its import goes out before the export does.
                let transfer = self.new_transfer(prefill, decode, None);
                req.kv_export = Some(transfer);
                let (prompt, output_len) = (r.prompt.clone(), r.output_len as usize);
                let first_token = None;
                let h =
                    Handoff { decode, first_token, transfer, import_tokens, prompt, output_len };
                (prefill, Some(h))
            }
        };
        if let Some(cp) = self.spec.control_plane {
            self.charge(e, cp.request_secs);
        }
        if self.execs[e].core.add_request(req).is_err() {
            self.rejected += 1;
            return Ok(());
        }
        let prompt = r.prompt.len() as u32;
        let turn = (!r.follow_ups.is_empty()).then(|| Box::new(r.clone()));
        let conversation = r.conversation;
        let track = Track {
            arrival: self.secs(),
            first: 0.0,
            last: 0.0,
            prompt,
            handoff,
            turn,
            conversation,
            model,
        };
        self.admit(e, id, track)
    }

    /// Request `id`, added to executor `e`'s core, is followed by `track`; `e` steps if idle.
    pub(super) fn admit(&mut self, e: usize, id: u64, track: Track) -> Result<(), String> {
        self.tracks.insert(id, track);
        self.execs[e].live += 1;
        self.wake(e)
    }
}
