//! The panel kernels: a chunk of blocks of `CG` groups converted once into an L1-sized panel
//! (codes, then scales and minimums), which every tile of `TILE` rows then reads, the rows'
//! accumulators waiting between chunks. The path for many rows (a prefill).

/// The panel kernels, for the instruction set of `$features` (expanded by `kernels!`).
macro_rules! panel_kernels {
    ($features:literal) => {
        /// Writes input `4t + E` (`HIGH`: `16 + …`) of the chunk's block `b` into the panel.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn panel_input<const F: u8, const HIGH: bool, const E: usize, const CG: usize>(
            q: &[*const u8; CG],
            lines: *mut f32,
            b: usize,
            t: usize,
        ) {
            // SAFETY: the panel holds every input of the `CG` groups.
            unsafe {
                let v = codes::<F, HIGH, E, CG>(q, t);
                let k = b * BLOCK + if HIGH { 16 } else { 0 } + 4 * t + E;
                for c in 0..CG {
                    for h in 0..NV {
                        store_line(lines.add((k * CG + c) * GROUP + h * LANES), v[c][h]);
                    }
                }
            }
        }

        /// Rows `row0 .. row0 + n` (`n ≤ RT`) over blocks `blocks` against a converted panel of
        /// `CG` groups holding those blocks (codes at line `k·CG + c` for the chunk's input
        /// `k`, then per block the scales and minimums at `params`). The tile's accumulators
        /// start at zero on the first block and are stored to `out` after the last; between
        /// chunks they wait in `accs` (`CG` lines per row of the block of rows from `base`).
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $features)]
        unsafe fn panel_tile<const F: u8, const CG: usize, const RT: usize>(
            (lines, params): (*const f32, *const f32),
            x: &[f32],
            sums: &[f32],
            (row0, n): (usize, usize),
            w: &QWeight,
            g0: usize,
            out: OutPtr,
            blocks: std::ops::Range<usize>,
            (accs, base): (*mut Line, usize),
        ) {
            // SAFETY: the panel holds what `panel` wrote for `blocks`; `accs` has `CG` lines for
            // every row from `base` to the tile's last; rows and groups as in `fused`.
            unsafe {
                let (xr, sr) = rows_at::<RT>(x, sums, w.cols, row0, n);
                let mut acc: Acc<RT, CG> = [[[zero(); NV]; CG]; RT];
                if blocks.start > 0 {
                    for r in 0..RT {
                        let line = accs.add((row0 - base + r.min(n - 1)) * CG).cast::<f32>();
                        for c in 0..CG {
                            for h in 0..NV {
                                acc[r][c][h] = load_line(line.add(c * GROUP + h * LANES));
                            }
                        }
                    }
                }
                let k0 = blocks.start * BLOCK;
                for b in blocks.clone() {
                    // The block's scales and minimums (`Q6K`: its halves' scales), read where
                    // they are used: fewer registers held across the inputs.
                    let params_of = |b: usize| {
                        let (mut d, mut m) = ([[zero(); NV]; CG], [[zero(); NV]; CG]);
                        for c in 0..CG {
                            for h in 0..NV {
                                let at = ((b - blocks.start) * CG + c) * 2 * GROUP + h * LANES;
                                d[c][h] = load_line(params.add(at));
                                m[c][h] = load_line(params.add(at + GROUP));
                            }
                        }
                        (d, m)
                    };
                    let mut p: Acc<RT, CG> = [[[zero(); NV]; CG]; RT];
                    for k in b * BLOCK..(b + 1) * BLOCK {
                        if kind::halves(F) && k == b * BLOCK + BLOCK / 2 {
                            // A scale per half: the first half's sum ends here.
                            finish_half::<RT, CG>(&mut acc, &p, &params_of(b).0);
                            p = [[[zero(); NV]; CG]; RT];
                        }
                        let mut wv = [[zero(); NV]; CG];
                        for c in 0..CG {
                            for h in 0..NV {
                                let at = ((k - k0) * CG + c) * GROUP + h * LANES;
                                wv[c][h] = load_line(lines.add(at));
                            }
                        }
                        for r in 0..RT {
                            let xb = splat(xr[r].add(k));
                            for c in 0..CG {
                                for h in 0..NV {
                                    p[r][c][h] = fma(xb, wv[c][h], p[r][c][h]);
                                }
                            }
                        }
                    }
                    let (d, m) = params_of(b);
                    if kind::halves(F) {
                        finish_half::<RT, CG>(&mut acc, &p, &m);
                    } else {
                        finish_block::<F, RT, CG>(&mut acc, &p, &d, &m, &sr, b);
                    }
                }
                if blocks.end == w.cols / BLOCK {
                    store::<RT, CG>(&acc, w, row0, n, g0, out);
                } else {
                    for (r, row) in acc.iter().enumerate().take(n) {
                        let line = accs.add((row0 - base + r) * CG).cast::<f32>();
                        for (c, vs) in row.iter().enumerate() {
                            for (h, v) in vs.iter().enumerate() {
                                store_line(line.add(c * GROUP + h * LANES), *v);
                            }
                        }
                    }
                }
            }
        }

        /// Converts `CG` groups from `g0` into `panel` a chunk of blocks at a time (their codes
        /// and parameters), and runs rows `rows` through each chunk, `TILE` rows at a time. A
        /// chunk's codes are at most [`PANEL_BYTES`], so they stay in L1 while every row tile
        /// reads them; the rows' accumulators wait in `accs` (one entry per row of `rows`) from
        /// chunk to chunk.
        #[target_feature(enable = $features)]
        unsafe fn panel<const F: u8, const CG: usize>(
            x: &[f32],
            sums: &[f32],
            rows: std::ops::Range<usize>,
            w: &QWeight,
            g0: usize,
            out: OutPtr,
            (panel, accs): (&mut Vec<Line>, &mut Vec<Line>),
        ) {
            let bpr = w.cols / BLOCK;
            // Equal chunks of at most `PANEL_BYTES` of codes.
            let most = (PANEL_BYTES / (BLOCK * CG * GROUP * 4)).max(1);
            let chunks = bpr.div_ceil(most);
            let kb = bpr.div_ceil(chunks);
            panel.resize((kb * BLOCK + 2 * kb) * CG, Line([0.0; GROUP]));
            if chunks > 1 {
                accs.resize(rows.len() * CG, Line([0.0; GROUP]));
            }
            // SAFETY: as in `fused`; the panel was just sized for a chunk's inputs and blocks,
            // `accs` for every row of `rows`.
            unsafe {
                let lines = panel.as_mut_ptr().cast::<f32>();
                let params = lines.add(kb * BLOCK * CG * GROUP);
                let mut b0 = 0;
                while b0 < bpr {
                    let b1 = (b0 + kb).min(bpr);
                    for b in b0..b1 {
                        let (q, d, m) = block_params::<F, CG>(w, g0, b);
                        let at = b - b0;
                        for t in 0..4 {
                            panel_input::<F, false, 0, CG>(&q, lines, at, t);
                            panel_input::<F, false, 1, CG>(&q, lines, at, t);
                            panel_input::<F, false, 2, CG>(&q, lines, at, t);
                            panel_input::<F, false, 3, CG>(&q, lines, at, t);
                            panel_input::<F, true, 0, CG>(&q, lines, at, t);
                            panel_input::<F, true, 1, CG>(&q, lines, at, t);
                            panel_input::<F, true, 2, CG>(&q, lines, at, t);
                            panel_input::<F, true, 3, CG>(&q, lines, at, t);
                        }
                        for c in 0..CG {
                            for h in 0..NV {
                                let at = (at * CG + c) * 2 * GROUP + h * LANES;
                                store_line(params.add(at), d[c][h]);
                                store_line(params.add(at + GROUP), m[c][h]);
                            }
                        }
                    }
                    let tiles = (lines.cast_const(), params.cast_const());
                    let accs = (accs.as_mut_ptr(), rows.start);
                    let mut r = rows.start;
                    while r < rows.end {
                        let n = (rows.end - r).min(TILE);
                        let at = (r, n);
                        let bs = b0..b1;
                        match n {
                            1 => panel_tile::<F, CG, 1>(tiles, x, sums, at, w, g0, out, bs, accs),
                            2 => panel_tile::<F, CG, 2>(tiles, x, sums, at, w, g0, out, bs, accs),
                            _ if n <= TILE / 2 => panel_tile::<F, CG, { TILE / 2 }>(
                                tiles, x, sums, at, w, g0, out, bs, accs,
                            ),
                            _ => {
                                panel_tile::<F, CG, TILE>(tiles, x, sums, at, w, g0, out, bs, accs)
                            }
                        }
                        r += n;
                    }
                    b0 = b1;
                }
            }
        }
    };
}
