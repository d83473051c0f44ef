use super::draw::{rank_key, DRAW_BLOCK};
use super::*;
use ferry_proto::v1;

fn with_temperature(temperature: f32) -> SamplingParams {
    SamplingParams { temperature, seed: 7, ..SamplingParams::default() }
}

/// Deterministic pseudo-random logits in [0, 4).
fn random_logits(vocab: usize, salt: u64) -> Vec<f32> {
    (0..vocab as u64).map(|i| (position_uniform(salt, i) * 4.0) as f32).collect()
}

fn sample_once(logits: &[f32], params: &SamplingParams, position: u64) -> Sampled {
    let mut row = logits.to_vec();
    sample(&mut row, params, &[], &[], position).expect("valid input")
}

fn draw_counts(logits: &[f32], params: &SamplingParams, draws: u64) -> Vec<u64> {
    let mut sampler = Sampler::new();
    let mut counts = vec![0; logits.len()];
    for position in 0..draws {
        let mut row = logits.to_vec();
        let token = sampler.sample(&mut row, params, &[], &[], position).unwrap().token;
        counts[token as usize] += 1;
    }
    counts
}

fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&l| f64::from(l) / f64::from(temperature)).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .filter(|(_, &p)| p > 0.0)
        .map(|(&c, &p)| {
            let expected = p * n as f64;
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

/// The rank key of the k-th best logit (0 < k < len).
fn kth_best(logits: &[f32], k: usize, keys: &mut Vec<u64>) -> u64 {
    top_k_keys(logits, k, keys)[0]
}

/// (id, value) best first, lower id first on ties.
fn best_first(values: &[f32]) -> Vec<(u32, f32)> {
    let mut ranked: Vec<(u32, f32)> =
        values.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked
}

fn argmax_of(logits: &[f32]) -> u32 {
    argmax(logits).unwrap()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let p = SamplingParams::default();
    assert_eq!(sample_once(&[1.0, 3.0, 3.0, -2.0], &p, 0).token, 1);
    assert_eq!(sample_once(&[5.0], &p, 9).token, 0);
    let logits = random_logits(49_152, 1);
    assert_eq!(sample_once(&logits, &p, 3).token, argmax_of(&logits));
    // Truncation knobs cannot change an argmax.
    let knobs = SamplingParams { top_p: 0.1, min_p: 0.5, top_k: 3, ..p };
    assert_eq!(sample_once(&logits, &knobs, 3).token, argmax_of(&logits));
}

#[test]
fn top_k_one_equals_greedy_at_any_temperature() {
    let logits = random_logits(1000, 2);
    for temperature in [0.0, 0.5, 1.0, 5.0, 100.0] {
        let p = SamplingParams { top_k: 1, ..with_temperature(temperature) };
        for position in 0..50 {
            assert_eq!(sample_once(&logits, &p, position).token, argmax_of(&logits));
        }
    }
}

#[test]
fn same_seed_and_position_give_the_same_token_whatever_ran_before() {
    let logits = random_logits(500, 3);
    let p = SamplingParams { top_p: 0.9, ..with_temperature(1.0) };
    let mut busy = Sampler::new();
    for position in 0..20 {
        let mut other = random_logits(800, position);
        let noise = SamplingParams { seed: 99, repetition_penalty: 1.3, ..p };
        busy.sample(&mut other, &noise, &[1, 2, 3], &[4, 4], position).unwrap();
    }
    for position in 0..20 {
        let mut row = logits.clone();
        let from_busy = busy.sample(&mut row, &p, &[], &[], position).unwrap().token;
        assert_eq!(from_busy, sample_once(&logits, &p, position).token);
    }
}

#[test]
fn draws_vary_with_position_and_seed() {
    let flat = vec![0.0; 50];
    let p = with_temperature(1.0);
    let by_position: std::collections::HashSet<u32> =
        (0..100).map(|pos| sample_once(&flat, &p, pos).token).collect();
    assert!(by_position.len() > 25, "only {} distinct tokens", by_position.len());
    let by_seed: std::collections::HashSet<u32> =
        (0..100).map(|seed| sample_once(&flat, &SamplingParams { seed, ..p }, 5).token).collect();
    assert!(by_seed.len() > 25, "only {} distinct tokens", by_seed.len());
}

#[test]
fn uniform_is_in_unit_interval_with_mean_one_half() {
    let n = 100_000;
    let mut sum = 0.0;
    for position in 0..n {
        let u = position_uniform(42, position);
        assert!((0.0..1.0).contains(&u));
        sum += u;
    }
    assert!((sum / n as f64 - 0.5).abs() < 0.005);
}

#[test]
fn a_restarted_request_continues_exactly() {
    // A toy model whose logits depend on the history, as a real one's do.
    fn logits_after(history: &[u32]) -> Vec<f32> {
        let salt = history.iter().fold(0u64, |h, &t| position_hash(h, u64::from(t)));
        random_logits(300, salt)
    }
    let p = SamplingParams {
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.2,
        frequency_penalty: 0.3,
        ..with_temperature(0.8)
    };
    let prompt = [5, 6, 7];
    let generate = |sampler: &mut Sampler, output: &mut Vec<u32>, until: usize| {
        while output.len() < until {
            let history: Vec<u32> = prompt.iter().chain(output.iter()).copied().collect();
            let mut row = logits_after(&history);
            let position = history.len() as u64;
            output.push(sampler.sample(&mut row, &p, &prompt, output, position).unwrap().token);
        }
    };
    let mut straight = Vec::new();
    generate(&mut Sampler::new(), &mut straight, 20);
    let mut resumed = straight[..10].to_vec();
    generate(&mut Sampler::new(), &mut resumed, 20);
    assert_eq!(straight, resumed);
}

#[test]
fn temperature_one_matches_softmax() {
    let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
    let counts = draw_counts(&logits, &with_temperature(1.0), 20_000);
    // 4 degrees of freedom: 18.5 is the 0.1% critical value; the draws are fixed, so this
    // is a regression check on the generator and the inverse CDF, not a flaky test.
    let chi = chi_square(&counts, &softmax(&logits, 1.0));
    assert!(chi < 18.5, "chi-square {chi}, counts {counts:?}");
}

#[test]
fn temperature_scales_the_distribution() {
    let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
    for temperature in [0.5, 2.0] {
        let counts = draw_counts(&logits, &with_temperature(temperature), 20_000);
        let chi = chi_square(&counts, &softmax(&logits, temperature));
        assert!(chi < 18.5, "T={temperature}: chi-square {chi}, counts {counts:?}");
    }
}

#[test]
fn top_p_matches_softmax_when_nothing_is_cut() {
    let probs = [0.4f32, 0.3, 0.2, 0.1];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let p = SamplingParams { top_p: 0.95, ..with_temperature(1.0) };
    let counts = draw_counts(&logits, &p, 20_000);
    let chi = chi_square(&counts, &softmax(&logits, 1.0));
    assert!(chi < 16.3, "chi-square {chi}, counts {counts:?}"); // 3 dof, 0.1%
}

#[test]
fn top_k_keeps_the_k_best_renormalised() {
    let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
    let p = SamplingParams { top_k: 3, ..with_temperature(1.0) };
    let counts = draw_counts(&logits, &p, 20_000);
    assert_eq!(&counts[3..], &[0, 0]);
    let chi = chi_square(&counts[..3], &softmax(&logits[..3], 1.0));
    assert!(chi < 13.9, "chi-square {chi}, counts {counts:?}"); // 2 dof, 0.1%

    let big = random_logits(1000, 4);
    let best: Vec<u32> = best_first(&big)[..10].iter().map(|c| c.0).collect();
    let p = SamplingParams { top_k: 10, ..with_temperature(3.0) };
    let counts = draw_counts(&big, &p, 2000);
    let drawn: Vec<u32> = (0..1000).filter(|&i| counts[i as usize] > 0).collect();
    assert!(drawn.iter().all(|t| best.contains(t)), "drew {drawn:?}, top 10 {best:?}");
    assert!(drawn.len() >= 8);
}

#[test]
fn top_p_keeps_the_nucleus_only() {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = SamplingParams { top_p: 0.75, ..with_temperature(1.0) };
    let counts = draw_counts(&logits, &p, 5000);
    assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
    assert_eq!(&counts[2..], &[0, 0]);
    // 0.5 / 0.8 of the nucleus.
    let share = counts[0] as f64 / 5000.0;
    assert!((share - 0.625).abs() < 0.03, "{share}");
}

#[test]
fn top_p_nucleus_equals_brute_force_even_with_ties() {
    // Quantised weights make many ties, which the nucleus breaks by lower id.
    let tied: Vec<f32> = random_logits(3000, 8).iter().map(|l| (l * 4.0).round() / 16.0).collect();
    let smooth: Vec<f32> = random_logits(5000, 5).iter().map(|l| (l - 4.0).exp()).collect();
    for weights in [tied, smooth] {
        for top_p in [0.01, 0.3, 0.5, 0.9, 0.999] {
            let ranked = best_first(&weights);
            let target = f64::from(top_p) * weights.iter().map(|&w| f64::from(w)).sum::<f64>();
            let mut cumulative = 0.0;
            let len = 1 + ranked
                .iter()
                .position(|&(_, w)| {
                    cumulative += f64::from(w);
                    cumulative >= target
                })
                .unwrap();
            let cutoff = nucleus_cutoff(&weights, top_p, &mut Vec::new());
            let (id, w) = ranked[len - 1];
            assert_eq!(cutoff, rank_key(w, id), "top_p {top_p}, brute-force length {len}");
        }
    }
    let logits = random_logits(5000, 5);
    let p = SamplingParams { top_p: 0.5, ..with_temperature(1.0) };
    let weights: Vec<f32> = logits.iter().map(|l| (l - 4.0).exp()).collect();
    let cutoff = nucleus_cutoff(&weights, 0.5, &mut Vec::new());
    let mut drawn = std::collections::HashSet::new();
    for position in 0..300 {
        let token = sample_once(&logits, &p, position).token;
        assert!(rank_key(weights[token as usize], token) >= cutoff);
        drawn.insert(token);
    }
    assert!(drawn.len() > 100, "{}", drawn.len());
}

#[test]
fn kth_best_breaks_ties_by_lower_id() {
    let logits = [1.0, 3.0, 2.0, 3.0, 2.0, 2.0, f32::NEG_INFINITY];
    let mut keys = Vec::new();
    assert_eq!(kth_best(&logits, 1, &mut keys), rank_key(3.0, 1));
    assert_eq!(kth_best(&logits, 2, &mut keys), rank_key(3.0, 3));
    assert_eq!(kth_best(&logits, 4, &mut keys), rank_key(2.0, 4));
    assert_eq!(kth_best(&logits, 6, &mut keys), rank_key(1.0, 0));
    assert!(rank_key(-1.0, 0) < rank_key(-0.5, 9) && rank_key(0.0, 0) < rank_key(1e-30, 0));
    for value in [0.0, -0.0, 1.5, -3.25, f32::MAX, f32::NEG_INFINITY, 1e-40] {
        assert_eq!(key_value(rank_key(value, 17)).to_bits(), value.to_bits());
    }
    // The block-maximum prefilter (small k) agrees with brute force, ties included.
    let tied: Vec<f32> = random_logits(10_000, 9).iter().map(|l| (l * 8.0).round()).collect();
    let ranked = best_first(&tied);
    for k in [1, 5, 50, 78, 200, 5000, 9999] {
        let (id, l) = ranked[k - 1];
        assert_eq!(kth_best(&tied, k, &mut keys), rank_key(l, id), "k {k}");
        let mut top = Vec::new();
        top_n(&tied, k, &mut keys, &mut top);
        assert_eq!(top, ranked[..k], "k {k}");
    }
}

#[test]
fn fast_exp_matches_std_exp() {
    let mut x = 0.0f32;
    while x > -87.0 {
        let (fast, exact) = (f64::from(exp_nonpositive(x)), f64::from(x).exp());
        assert!(((fast - exact) / exact).abs() < 3e-7, "x {x}: {fast} vs {exact}");
        x -= 0.000_37;
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-88.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
}

#[test]
fn inverse_cdf_walks_blocks_and_skips_zero_weights() {
    let mut weights = vec![0.0; 3 * DRAW_BLOCK + 7];
    weights[5] = 1.0;
    weights[DRAW_BLOCK + 3] = 1.0;
    weights[3 * DRAW_BLOCK + 2] = 2.0;
    assert_eq!(inverse_cdf(&weights, 0.0), 5);
    assert_eq!(inverse_cdf(&weights, 0.24), 5);
    assert_eq!(inverse_cdf(&weights, 0.26), DRAW_BLOCK as u32 + 3);
    assert_eq!(inverse_cdf(&weights, 0.51), 3 * DRAW_BLOCK as u32 + 2);
    assert_eq!(inverse_cdf(&weights, 1.0 - f64::EPSILON), 3 * DRAW_BLOCK as u32 + 2);
}

#[test]
fn min_p_drops_tokens_below_its_share_of_the_best() {
    let logits: Vec<f32> = [0.6f32, 0.3, 0.05, 0.05].iter().map(|p| p.ln()).collect();
    for top_k in [0, 3] {
        let p = SamplingParams { min_p: 0.1, top_k, ..with_temperature(1.0) };
        let counts = draw_counts(&logits, &p, 3000);
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
        assert_eq!(&counts[2..], &[0, 0], "top_k {top_k}");
    }
}

#[test]
fn repetition_penalty_lowers_prompt_and_output_tokens() {
    let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::default() };
    let mut logits = vec![2.0, -1.0, 1.5, 0.5];
    let token = sample(&mut logits, &p, &[0, 0], &[1], 4).unwrap().token;
    // Positive logits are divided, negative ones multiplied, each token once.
    assert_eq!(logits, vec![1.0, -2.0, 1.5, 0.5]);
    assert_eq!(token, 2);
    // Under sampling the repeated favourite loses probability.
    let flat = [1.0, 1.0];
    let p = SamplingParams { repetition_penalty: 2.0, ..with_temperature(1.0) };
    let mut sampler = Sampler::new();
    let hits = (0..2000)
        .filter(|&pos| {
            let mut row = flat.to_vec();
            sampler.sample(&mut row, &p, &[0], &[], pos).unwrap().token == 0
        })
        .count();
    assert!((650..850).contains(&hits), "{hits}"); // softmax([0.5, 1])[0] = 0.378
}

#[test]
fn presence_and_frequency_penalise_output_tokens_only() {
    let p = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    };
    let mut logits = vec![1.0; 4];
    sample(&mut logits, &p, &[0, 3], &[1, 1, 1, 2], 7).unwrap();
    assert_eq!(logits, vec![1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0]);
    let frequency_only = SamplingParams { frequency_penalty: 1.0, ..SamplingParams::default() };
    let mut logits = vec![0.0; 3];
    sample(&mut logits, &frequency_only, &[], &[2, 1, 2, 2], 4).unwrap();
    assert_eq!(logits, vec![0.0, -1.0, -3.0]);
}

#[test]
fn penalties_leave_no_state_behind_and_ignore_ids_outside_the_vocabulary() {
    let p = SamplingParams {
        repetition_penalty: 1.5,
        presence_penalty: 1.0,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new();
    let mut big = vec![1.0; 100];
    sampler.sample(&mut big, &p, &[10, 99], &[50, 50], 4).unwrap();
    let mut small = vec![1.0; 20];
    sampler.sample(&mut small, &p, &[3, 50, u32::MAX], &[4, 99], 5).unwrap();
    let mut expected = vec![1.0; 20];
    expected[3] = 1.0 / 1.5;
    expected[4] = 1.0 / 1.5 - 1.0;
    assert_eq!(small, expected);
    assert!(sampler.marks.iter().all(|&m| m == 0));
}

#[test]
fn logprobs_are_log_softmax_of_the_raw_logits() {
    let raw = [1.0f32, 2.0, 3.0, 0.5];
    let log_z = raw.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
    let p = SamplingParams {
        logprobs: true,
        top_logprobs: 3,
        repetition_penalty: 1.5,
        presence_penalty: 1.0,
        ..with_temperature(0.7)
    };
    for position in 0..20 {
        let mut row = raw.to_vec();
        let got = sample(&mut row, &p, &[2], &[1], position).unwrap();
        let expected = f64::from(raw[got.token as usize]) - log_z;
        assert!((f64::from(got.logprob.unwrap()) - expected).abs() < 1e-5);
        let ids: Vec<u32> = got.top_logprobs.iter().map(|e| e.0).collect();
        assert_eq!(ids, vec![2, 1, 0]);
        for (id, lp) in got.top_logprobs {
            assert!((f64::from(lp) - (f64::from(raw[id as usize]) - log_z)).abs() < 1e-5);
        }
    }
}

#[test]
fn top_logprobs_length_ties_and_opt_in() {
    let with = SamplingParams { logprobs: true, top_logprobs: 2, ..SamplingParams::default() };
    let got = sample_once(&[1.0, 1.0, 1.0], &with, 0);
    assert_eq!(got.top_logprobs.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 1]);
    let more_than_vocab = SamplingParams { top_logprobs: MAX_TOP_LOGPROBS, ..with };
    assert_eq!(sample_once(&[0.0, 1.0, 2.0], &more_than_vocab, 0).top_logprobs.len(), 3);
    let big = sample_once(&random_logits(49_152, 6), &more_than_vocab, 0);
    assert_eq!(big.top_logprobs.len(), 20);
    assert!(big.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
    let only_logprob = SamplingParams { top_logprobs: 0, ..with };
    let got = sample_once(&[0.0, 1.0], &only_logprob, 0);
    assert!(got.logprob.is_some() && got.top_logprobs.is_empty());
    let off = SamplingParams { logprobs: false, ..with };
    let got = sample_once(&[0.0, 1.0], &off, 0);
    assert_eq!(got, Sampled { token: 1, logprob: None, top_logprobs: vec![] });
}

#[test]
fn validation_names_the_bad_parameter() {
    let ok = SamplingParams::default();
    let cases = [
        ("temperature", SamplingParams { temperature: -0.1, ..ok }),
        ("temperature", SamplingParams { temperature: f32::NAN, ..ok }),
        ("temperature", SamplingParams { temperature: f32::INFINITY, ..ok }),
        ("top_p", SamplingParams { top_p: 1.5, ..ok }),
        ("top_p", SamplingParams { top_p: -0.1, ..ok }),
        ("min_p", SamplingParams { min_p: 1.1, ..ok }),
        ("min_p", SamplingParams { min_p: -0.01, ..ok }),
        ("repetition_penalty", SamplingParams { repetition_penalty: -1.0, ..ok }),
        ("presence_penalty", SamplingParams { presence_penalty: 2.5, ..ok }),
        ("frequency_penalty", SamplingParams { frequency_penalty: -3.0, ..ok }),
        ("frequency_penalty", SamplingParams { frequency_penalty: f32::NAN, ..ok }),
    ];
    for (name, params) in cases {
        match params.validate() {
            Err(e @ SamplingError::InvalidParam { param, .. }) => {
                assert_eq!(param, name);
                assert!(e.to_string().contains(name), "{e}");
            }
            other => panic!("{name}: expected InvalidParam, got {other:?}"),
        }
        assert!(sample(&mut [1.0], &params, &[], &[], 0).is_err());
    }
    let too_many = SamplingParams { top_logprobs: MAX_TOP_LOGPROBS + 1, ..ok };
    assert_eq!(
        too_many.validate(),
        Err(SamplingError::TooManyTopLogprobs { param: "top_logprobs", requested: 21, max: 20 })
    );
    let edges = SamplingParams { top_p: 1.0, min_p: 1.0, presence_penalty: -2.0, ..ok };
    assert_eq!(edges.validate(), Ok(()));
}

#[test]
fn bad_logits_are_errors_or_excluded_never_panics() {
    for p in [SamplingParams::default(), with_temperature(1.0)] {
        assert_eq!(sample(&mut [], &p, &[], &[], 0), Err(SamplingError::EmptyLogits));
        let mut dead = [f32::NEG_INFINITY, f32::NAN];
        assert_eq!(sample(&mut dead, &p, &[], &[], 0), Err(SamplingError::NoFiniteLogit));
        for position in 0..100 {
            let token = sample_once(&[f32::NAN, 0.0, f32::NAN, -1.0], &p, position).token;
            assert!(token == 1 || token == 3);
            let token = sample_once(&[0.0, f32::INFINITY, f32::INFINITY], &p, position).token;
            assert!(token == 1 || token == 2);
        }
    }
    let subnormal = with_temperature(1e-45);
    assert_eq!(sample_once(&[0.0, 1.0, 0.5], &subnormal, 0).token, 1);
    let tiny_penalty = SamplingParams { repetition_penalty: 1e-38, ..with_temperature(1.0) };
    let token = sample(&mut [3.0, 1.0], &tiny_penalty, &[0], &[], 0).unwrap().token;
    assert_eq!(token, 0);
}

#[test]
fn proto_conversion_fills_a_missing_seed() {
    let wire = v1::SamplingParams {
        temperature: 0.8,
        top_k: 5,
        top_logprobs: 2,
        logprobs: true,
        ..Default::default()
    };
    let p = SamplingParams::from_proto(&wire, 1234);
    assert_eq!((p.seed, p.temperature, p.top_k, p.top_logprobs), (1234, 0.8, 5, 2));
    assert!(p.logprobs);
    let seeded = v1::SamplingParams { seed: Some(9), ..wire };
    assert_eq!(SamplingParams::from_proto(&seeded, 1234).seed, 9);
}

#[test]
fn a_logit_bias_changes_the_draw_but_not_the_reported_logprob() {
    let logits = random_logits(300, 3);
    let params = SamplingParams { logprobs: true, top_logprobs: 2, ..SamplingParams::default() };
    let plain = sample_once(&logits, &params, 0);
    // +100 on the worst token makes it the greedy choice.
    let worst = best_first(&logits).last().unwrap().0;
    let adjust =
        LogitAdjust { bias: vec![(worst, 100.0)], allowed: vec![], ..LogitAdjust::default() };
    let mut row = logits.clone();
    let biased = Sampler::new().sample_adjusted(&mut row, &params, &adjust, &[], &[], 0).unwrap();
    assert_eq!(biased.token, worst);
    // Its log-probability and the top alternatives are the model's, as if unbiased.
    let raw = f64::from(logits[worst as usize]) - log_sum_exp(&logits, &mut Vec::new());
    assert!((f64::from(biased.logprob.unwrap()) - raw).abs() < 1e-5, "{biased:?}");
    assert_eq!(biased.top_logprobs, plain.top_logprobs);
    // -100 on the best token: never chosen.
    let best = plain.token;
    let adjust =
        LogitAdjust { bias: vec![(best, -100.0)], allowed: vec![], ..LogitAdjust::default() };
    let mut row = logits.clone();
    let s = Sampler::new().sample_adjusted(&mut row, &params, &adjust, &[], &[], 0).unwrap();
    assert_ne!(s.token, best);
}

#[test]
fn allowed_token_ids_bound_every_draw() {
    let logits = random_logits(500, 9);
    let allowed = vec![3, 77, 499];
    let adjust = LogitAdjust { bias: vec![], allowed: allowed.clone(), ..LogitAdjust::default() };
    let params = with_temperature(1.5);
    let mut sampler = Sampler::new();
    let mut seen = std::collections::BTreeSet::new();
    for position in 0..300 {
        let mut row = logits.clone();
        let t = sampler.sample_adjusted(&mut row, &params, &adjust, &[], &[], position).unwrap();
        seen.insert(t.token);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), allowed, "each allowed id drawn, no other");
}

#[test]
fn logit_adjustments_are_checked_with_vllm_wording() {
    let check = |bias: Vec<(u32, f32)>, allowed: Vec<u32>| {
        LogitAdjust { bias, allowed, ..LogitAdjust::default() }
            .validate(100)
            .map_err(|e| e.to_string())
    };
    assert_eq!(check(vec![(5, 100.0), (6, -100.0)], vec![0, 99]), Ok(()));
    let err = check(vec![(100, 1.0)], vec![]).unwrap_err();
    assert!(err.contains("token_id 100 in logit_bias is out of vocabulary"), "{err}");
    let err = check(vec![(1, 100.5)], vec![]).unwrap_err();
    assert!(err.contains("must be in [-100, 100]"), "{err}");
    let err = check(vec![(1, f32::NAN)], vec![]).unwrap_err();
    assert!(err.contains("must be in [-100, 100]"), "{err}");
    let err = check(vec![], vec![100]).unwrap_err();
    assert!(err.contains("allowed_token_ids contains out-of-vocab token id 100"), "{err}");
    let many: Vec<(u32, f32)> = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect();
    let err = LogitAdjust { bias: many, allowed: vec![], ..LogitAdjust::default() }
        .validate(1000)
        .unwrap_err();
    assert!(err.to_string().contains("at most 300"), "{err}");
    // The wire form sorts and deduplicates.
    let p = v1::SamplingParams {
        logit_bias: [(9, 1.0), (2, -1.0)].into_iter().collect(),
        allowed_token_ids: vec![5, 1, 5],
        ..Default::default()
    };
    let a = LogitAdjust::from_proto(&p);
    assert_eq!((a.bias, a.allowed), (vec![(2, -1.0), (9, 1.0)], vec![1, 5]));
}

#[test]
fn a_bad_word_is_never_completed() {
    let logits = random_logits(200, 4);
    let order = best_first(&logits);
    let (first, second) = (order[0].0, order[1].0);
    let greedy = SamplingParams::default();
    let draw = |adjust: &LogitAdjust, output: &[u32]| {
        let mut row = logits.clone();
        Sampler::new().sample_adjusted(&mut row, &greedy, adjust, &[], output, 0).unwrap().token
    };
    // A one-token word is masked everywhere.
    let one = LogitAdjust { bad_words: vec![vec![first]], ..LogitAdjust::default() };
    assert_eq!(draw(&one, &[]), second);
    assert_eq!(draw(&one, &[7, 8]), second);
    // A two-token word: its last token is masked only right after its first.
    let two = LogitAdjust { bad_words: vec![vec![42, first]], ..LogitAdjust::default() };
    assert_eq!(draw(&two, &[1, 42]), second);
    assert_eq!(draw(&two, &[42, 1]), first);
    assert_eq!(draw(&two, &[]), first);
    // Checks: sizes, empty sequences, the vocabulary.
    let check = |bad_words: Vec<Vec<u32>>| {
        LogitAdjust { bad_words, ..LogitAdjust::default() }.validate(100).map_err(|e| e.to_string())
    };
    assert_eq!(check(vec![vec![1, 2], vec![99]]), Ok(()));
    assert!(check(vec![vec![]]).unwrap_err().contains("empty token sequence"));
    assert!(check(vec![vec![100]])
        .unwrap_err()
        .contains("bad_words contains out-of-vocab token id 100"));
    let many = vec![vec![1; 512], vec![2; 513]];
    assert!(check(many).unwrap_err().contains("bad_words take 1025 token ids; at most 1024"));
}

/// Rejection sampling is exact: whatever the drafter's distribution `q`, the tokens
/// `verify_draft` returns follow the target `p`. 200 000 draws with fixed uniforms (so the test
/// is deterministic) of a 5-token target against three drafters (one far from it, one
/// certain of a token, one equal to it); a chi-square test at the 0.1 % level (4 degrees of
/// freedom: critical value 18.47), and the acceptance rate within 1 % of its law,
/// sum over d of q(d) min(1, p(d)/q(d)).
#[test]
fn rejection_sampling_of_drafts_follows_the_target_distribution() {
    const DRAWS: u64 = 200_000;
    let p = [0.40f32, 0.25, 0.20, 0.10, 0.05];
    let drafters: [[f32; 5]; 3] =
        [[0.05, 0.05, 0.10, 0.30, 0.50], [0.0, 0.0, 1.0, 0.0, 0.0], [0.40, 0.25, 0.20, 0.10, 0.05]];
    let probs: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
    for q in drafters {
        let mut counts = [0u64; 5];
        let mut accepted = 0u64;
        for i in 0..DRAWS {
            // The drafter proposes d ~ q; the verifier accepts or resamples.
            let d = super::draw::inverse_cdf(&q, position_uniform(1, i));
            let (token, ok) =
                verify_draft(&p, &q, d, position_uniform(2, i), position_uniform(3, i));
            counts[token as usize] += 1;
            accepted += u64::from(ok);
        }
        let chi = chi_square(&counts, &probs);
        assert!(chi < 18.47, "q {q:?}: chi-square {chi} over {counts:?}");
        let law: f64 = q.iter().zip(&p).map(|(&q, &p)| f64::from(q.min(p))).sum::<f64>();
        let rate = accepted as f64 / DRAWS as f64;
        assert!((rate - law).abs() < 0.01, "q {q:?}: accepted {rate}, law {law}");
    }
}

/// The executor's verification of an n-gram draft (a certain proposal) draws each position as
/// decoding does and accepts the draft when the draw equals it: over many positions of a
/// sampled request (temperature 0.8, top-p 0.9), the accepted share is the draft's probability
/// under the request's sampling, and the tokens returned follow that distribution (chi-square
/// at 0.1 %, 4 degrees of freedom after pooling the tokens top-p drops, which never occur).
#[test]
fn a_certain_draft_is_accepted_with_its_probability_and_outputs_keep_their_law() {
    const DRAWS: u64 = 100_000;
    let logits = [2.0f32, 1.6, 1.2, 0.5, 0.1, -3.0];
    let params =
        SamplingParams { temperature: 0.8, top_p: 0.9, seed: 11, ..SamplingParams::default() };
    // The law after temperature and top-p (the nucleus keeps the tokens whose cumulative
    // probability, best first, reaches 0.9).
    let soft = softmax(&logits, 0.8);
    let mut kept = 0.0;
    let mut law = vec![0.0; logits.len()];
    for (i, &pr) in soft.iter().enumerate() {
        if kept < 0.9 {
            law[i] = pr;
            kept += pr;
        }
    }
    let total: f64 = law.iter().sum();
    for x in &mut law {
        *x /= total;
    }
    let draft = 1u32;
    let mut sampler = Sampler::new();
    let mut counts = vec![0u64; logits.len()];
    let mut accepted = 0u64;
    for position in 0..DRAWS {
        let mut row = logits.to_vec();
        let token = sampler.sample(&mut row, &params, &[], &[], position).unwrap().token;
        counts[token as usize] += 1;
        accepted += u64::from(token == draft);
    }
    let rate = accepted as f64 / DRAWS as f64;
    assert!((rate - law[1]).abs() < 0.01, "accepted {rate}, probability {}", law[1]);
    let live = law.iter().filter(|&&x| x > 0.0).count();
    assert_eq!(counts[live..].iter().sum::<u64>(), 0, "a token top-p drops was drawn");
    let chi = chi_square(&counts[..live], &law[..live]);
    assert!(chi < [0.0, 0.0, 10.83, 13.82, 16.27, 18.47][live - 1], "chi-square {chi} {counts:?}");
}
