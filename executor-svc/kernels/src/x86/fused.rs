//! The fused kernels: a tile of up to `FUSED` rows × `CG` groups with the codes converted in
//! registers as the inputs go by, every row using each converted input at once; each weight
//! is read once and converted once a pass. The path for few rows (a decode batch).

/// The fused kernels, for the instruction set of `$features` (expanded by `kernels!`).
macro_rules! fused_kernels {
    ($features:literal) => {
        /// Input `4t + E` (`HIGH`: `16 + 4t + E`) of a block, converted in registers:
        /// `p = fma(x, q, p)` for every row.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn fused_input<
            const F: u8,
            const HIGH: bool,
            const E: usize,
            const CG: usize,
            const RT: usize,
        >(
            q: &[*const u8; CG],
            xr: &[*const f32; RT],
            t: usize,
            p: &mut Acc<RT, CG>,
        ) {
            // SAFETY: `q` as in `codes`; each row has the block's 32 inputs at `xr[r]`.
            unsafe {
                let wv = codes::<F, HIGH, E, CG>(q, t);
                let k = if HIGH { 16 } else { 0 } + 4 * t + E;
                for r in 0..RT {
                    let xb = splat(xr[r].add(k));
                    for c in 0..CG {
                        for h in 0..NV {
                            p[r][c][h] = fma(xb, wv[c][h], p[r][c][h]);
                        }
                    }
                }
            }
        }

        /// One half of a block (inputs `0..16`, or `HIGH`: `16..32`), input by input.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn fused_half<const F: u8, const HIGH: bool, const CG: usize, const RT: usize>(
            q: &[*const u8; CG],
            xr: &[*const f32; RT],
            p: &mut Acc<RT, CG>,
        ) {
            for t in 0..4 {
                // SAFETY: the caller's contract.
                unsafe {
                    fused_input::<F, HIGH, 0, CG, RT>(q, xr, t, p);
                    fused_input::<F, HIGH, 1, CG, RT>(q, xr, t, p);
                    fused_input::<F, HIGH, 2, CG, RT>(q, xr, t, p);
                    fused_input::<F, HIGH, 3, CG, RT>(q, xr, t, p);
                }
            }
        }

        /// Rows `row0 .. row0 + n` (`n ≤ RT`) × groups `g0 .. g0 + CG`, the codes converted in
        /// registers as the inputs go by and used by every row at once.
        #[target_feature(enable = $features)]
        unsafe fn fused<const F: u8, const CG: usize, const RT: usize>(
            x: &[f32],
            sums: &[f32],
            (row0, n): (usize, usize),
            w: &QWeight,
            g0: usize,
            out: OutPtr,
        ) {
            // SAFETY: the caller keeps rows and groups in range and owns their columns.
            unsafe {
                let (xr, sr) = rows_at::<RT>(x, sums, w.cols, row0, n);
                let mut acc: Acc<RT, CG> = [[[zero(); NV]; CG]; RT];
                for b in 0..w.cols / BLOCK {
                    let q = block_params::<F, CG>(w, g0, b).0;
                    let mut p: Acc<RT, CG> = [[[zero(); NV]; CG]; RT];
                    let mut xb = xr;
                    for x in &mut xb {
                        *x = x.add(b * BLOCK);
                    }
                    fused_half::<F, false, CG, RT>(&q, &xb, &mut p);
                    if kind::halves(F) {
                        // A scale per half: the first half's sum ends before the second's.
                        let (_, d, _) = block_params::<F, CG>(w, g0, b);
                        finish_half::<RT, CG>(&mut acc, &p, &d);
                        p = [[[zero(); NV]; CG]; RT];
                        fused_half::<F, true, CG, RT>(&q, &xb, &mut p);
                        let (_, _, d_high) = block_params::<F, CG>(w, g0, b);
                        finish_half::<RT, CG>(&mut acc, &p, &d_high);
                        continue;
                    }
                    fused_half::<F, true, CG, RT>(&q, &xb, &mut p);
                    // Scales read after the block's inputs: fewer registers held across them.
                    let (_, d, m) = block_params::<F, CG>(w, g0, b);
                    finish_block::<F, RT, CG>(&mut acc, &p, &d, &m, &sr, b);
                }
                store::<RT, CG>(&acc, w, row0, n, g0, out);
            }
        }

        /// Fused tiles for rows `row0 .. row0 + n` (`n ≤ FUSED`), by the next tile size up.
        #[target_feature(enable = $features)]
        unsafe fn fused_any<const F: u8, const CG: usize>(
            x: &[f32],
            sums: &[f32],
            (row0, n): (usize, usize),
            w: &QWeight,
            g0: usize,
            out: OutPtr,
        ) {
            let at = (row0, n);
            // SAFETY: the caller's contract.
            unsafe {
                match n {
                    1 => fused::<F, CG, 1>(x, sums, at, w, g0, out),
                    _ if n <= FUSED / 2 => fused::<F, CG, { FUSED / 2 }>(x, sums, at, w, g0, out),
                    _ => fused::<F, CG, FUSED>(x, sums, at, w, g0, out),
                }
            }
        }
    };
}
