//! LoRA adapters in the core (vLLM's `max_loras` rule): the executor holds a request's adapter
//! from its first admission until it retires, preempted or not; a request of an adapter it
//! does not hold waits while it holds `max_loras` others, without holding back requests of held
//! adapters (or of none) behind it, and is admitted once the last holder of one retires.

use crate::common::{req, scheduled_ids, small_cfg, tokens, Harness};
use ferry_sched_core::*;

fn add(h: &mut Harness, id: u64, adapter: u64, max_tokens: usize) {
    let mut r = req(id, tokens(id as u32 * 10, 5), max_tokens);
    r.adapter = adapter;
    r.ignore_eos = true;
    h.add(r);
}

#[test]
fn a_request_of_a_new_adapter_waits_while_max_loras_others_are_held() {
    let mut h = Harness::new(SchedulerConfig { max_loras: 2, ..small_cfg() });
    // Adapters 7 and 8 take the executor's two; 9 must wait; 7 again and none go past it.
    add(&mut h, 1, 7, 2);
    add(&mut h, 2, 8, 8);
    add(&mut h, 3, 9, 2);
    add(&mut h, 4, 7, 2);
    add(&mut h, 5, 0, 2);
    let (plan, _) = h.step(5);
    assert_eq!(scheduled_ids(&plan), vec![1, 2, 4, 5]);
    assert_eq!(h.view(3).last_decision, Decision::LoraWait);
    assert_eq!(h.core.lora_adapters(), (vec![7, 8], vec![9]));
    assert_eq!(h.core.stats().lora_waits, 1);
    // Requests 1, 4 and 5 finish at their second token; 3 runs once 7's last holder retired,
    // and never while 7 and 8 were both held (the harness checks the invariants, max_loras
    // among them, after every call).
    let mut admitted_at = None;
    for step in 2..10 {
        let (plan, _) = h.step(5);
        if scheduled_ids(&plan).contains(&3) {
            admitted_at = Some(step);
            for gone in [1, 4] {
                assert!(!h.core.contains(RequestId(gone)), "adapter 7's holder {gone} retired");
            }
            break;
        }
        let waits = h.view(3).last_decision;
        assert!(matches!(waits, Decision::LoraWait | Decision::NoSlot), "step {step}: {waits:?}");
    }
    assert!(admitted_at.is_some(), "request 3 was never admitted");
    assert_eq!(h.core.lora_adapters().0, vec![8, 9]);
    h.drain(5, 20);
    assert_eq!(h.core.lora_adapters(), (vec![], vec![]), "every adapter let go");
}

#[test]
fn a_preempted_request_keeps_its_adapter_held() {
    // Room for one long request's blocks at a time: one of the first two is preempted, and the
    // executor still holds its adapter (it keeps preempted requests), so a third adapter waits
    // until one of them retires.
    let cfg = SchedulerConfig { max_loras: 2, num_blocks: 5, ..small_cfg() };
    let mut h = Harness::new(cfg);
    add(&mut h, 1, 7, 10);
    add(&mut h, 2, 8, 10);
    add(&mut h, 3, 9, 2);
    let mut preempted = false;
    for step in 0..60 {
        if h.core.is_drained() {
            break;
        }
        let (plan, _) = h.step(5);
        let both = h.core.contains(RequestId(1)) && h.core.contains(RequestId(2));
        assert!(!(both && scheduled_ids(&plan).contains(&3)), "step {step}: 3 ran beside 7, 8");
        for id in [1, 2] {
            if h.core.contains(RequestId(id)) && h.view(id).status == RequestStatus::Waiting {
                preempted = true;
                assert_eq!(h.core.lora_adapters().0, vec![7, 8], "step {step}: {id} preempted");
            }
        }
    }
    assert!(preempted, "neither request was preempted");
    assert!(h.core.is_drained(), "every request finished");
}
