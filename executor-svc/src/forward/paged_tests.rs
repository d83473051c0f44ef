//! The batch split between threads.
use super::{parts_of, SeqSlice};

/// Parts cover the batch in order, none empty, as many as threads allow (or sequences
/// exist), and a part closes as soon as it has its share of the tokens, so none holds more
/// than its share plus the one sequence that crossed the line. Over random batches of up to
/// 20 sequences of 1–300 tokens (decode rows among prefill chunks) and 1–4 threads.
#[test]
fn parts_split_the_batch_in_order_and_evenly() {
    let mut seed = 7u64;
    let mut next = |m: usize| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) as usize % m
    };
    let tokens = vec![0u32; 300];
    let mut split = 0;
    for _ in 0..500 {
        let lens: Vec<usize> =
            (0..=next(20)).map(|_| if next(3) == 0 { 1 + next(300) } else { 1 }).collect();
        let batch: Vec<SeqSlice> =
            lens.iter().map(|&n| SeqSlice::base(&tokens[..n], 0, &[], 1)).collect();
        let threads = 1 + next(4);
        let parts = parts_of(&batch, threads);
        assert_eq!(parts.len(), threads.min(batch.len()), "{lens:?} on {threads} threads");
        let total: usize = lens.iter().sum();
        let mut end = 0;
        for (i, part) in parts.iter().enumerate() {
            assert_eq!(part.start, end, "parts in order, without gaps");
            assert!(!part.is_empty(), "{lens:?}: part {i} is empty");
            let held: usize = lens[part.clone()].iter().sum();
            let last = lens[part.end - 1];
            assert!(held - last <= total.div_ceil(parts.len()), "{lens:?}: part {i} too big");
            end = part.end;
        }
        assert_eq!(end, batch.len());
        split += usize::from(parts.len() > 1);
    }
    assert!(split > 300, "only {split} of 500 batches were split");
}
