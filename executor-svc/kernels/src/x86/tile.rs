//! The parts of a register tile that the fused and the panel kernels share, written once over
//! an instruction set's primitives (`V`, `zero`, `fma`, `mul`, `splat`, `f16s`, `bf16s`, `f32s`,
//! `i8s`, `nibble`, `byte`, `load_line`, `store_line`, defined by the module that expands it): the tile's
//! accumulators, its rows' pointers, a block's codes as floats and its scales and minimums,
//! the end of a block (scales and minimums applied), and the store of a finished tile.

/// A register tile's shared parts, for the instruction set of `$features` (expanded by
/// `kernels!` after its constants).
macro_rules! tile_parts {
    ($features:literal) => {
        /// `V` registers of a tile: `[row][group][half]`.
        type Acc<const RT: usize, const CG: usize> = [[[V; NV]; CG]; RT];

        /// Pointers to `RT` activation rows (and their block sums) from `row0`; rows past `n`
        /// repeat the last real one (computed, never stored), so a few tile sizes serve every
        /// row count.
        #[inline]
        #[target_feature(enable = $features)]
        fn rows_at<const RT: usize>(
            x: &[f32],
            sums: &[f32],
            cols: usize,
            row0: usize,
            n: usize,
        ) -> ([*const f32; RT], [*const f32; RT]) {
            let mut xr = [x.as_ptr(); RT];
            // Empty for weights without minimums, which never read them.
            let mut sr = [sums.as_ptr(); RT];
            for r in 0..RT {
                let row = row0 + r.min(n - 1);
                xr[r] = x[row * cols..].as_ptr();
                sr[r] = sums.as_ptr().wrapping_add(row * (cols / BLOCK));
            }
            (xr, sr)
        }

        /// Stores the `n` real rows of a tile of `CG` groups from `g0`.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn store<const RT: usize, const CG: usize>(
            acc: &Acc<RT, CG>,
            w: &QWeight,
            row0: usize,
            n: usize,
            g0: usize,
            out: OutPtr,
        ) {
            // SAFETY: the caller owns these rows' columns of groups `g0 .. g0 + CG`.
            unsafe {
                for (r, row) in acc.iter().enumerate().take(n) {
                    for (c, vs) in row.iter().enumerate() {
                        let g = g0 + c;
                        let mut sums = Line([0.0; GROUP]);
                        for (h, v) in vs.iter().enumerate() {
                            store_line(sums.0.as_mut_ptr().add(h * LANES), *v);
                        }
                        if (g + 1) * GROUP <= w.rows {
                            let dst = out.at(row0 + r, g * GROUP);
                            std::ptr::copy_nonoverlapping(sums.0.as_ptr(), dst, GROUP);
                        } else {
                            store_group(w, row0 + r, g, &sums.0, out);
                        }
                    }
                }
            }
        }

        /// Block `b` of `CG` groups from `g0`: code pointers, scales and minimums (`Q6K`: the
        /// second half's scales).
        #[inline]
        #[target_feature(enable = $features)]
        #[allow(clippy::type_complexity)]
        unsafe fn block_params<const F: u8, const CG: usize>(
            w: &QWeight,
            g0: usize,
            b: usize,
        ) -> ([*const u8; CG], [[V; NV]; CG], [[V; NV]; CG]) {
            let bpr = w.cols / BLOCK;
            let cb = kind::code_bytes(F);
            let second = kind::has_min(F) || kind::halves(F);
            let mut q = [w.q.as_ptr(); CG];
            let (mut d, mut m) = ([[zero(); NV]; CG], [[zero(); NV]; CG]);
            // SAFETY: groups `g0 .. g0 + CG` exist; each has `bpr` blocks of parameters.
            unsafe {
                for c in 0..CG {
                    let gb = (g0 + c) * bpr + b;
                    q[c] = w.q.as_ptr().add(gb * GROUP * cb);
                    for h in 0..NV {
                        let at = gb * GROUP + h * LANES;
                        if kind::float(F) {
                            // No parameters: a scale of 1 (`fma(p, 1, acc)` is `acc + p`).
                            d[c][h] = splat(&1.0);
                        } else if kind::wide(F) {
                            // The super-block's f16 scales times the block's factors (exact).
                            let s = (gb >> w.shift) * GROUP + h * LANES;
                            d[c][h] = mul(f16s(w.d.as_ptr().add(s)), i8s(w.dq.as_ptr().add(at)));
                            if second {
                                let f = i8s(w.mq.as_ptr().add(at));
                                m[c][h] = mul(f16s(w.m.as_ptr().add(s)), f);
                            }
                        } else {
                            d[c][h] = f16s(w.d.as_ptr().add(at));
                            if second {
                                m[c][h] = f16s(w.m.as_ptr().add(at));
                            }
                        }
                    }
                }
            }
            (q, d, m)
        }

        /// The codes of input `4t + E` (`HIGH`: `16 + 4t + E`) of a block, for `CG` groups, as
        /// floats: lane `j` of the dwords at quad `t` holds column `j`'s code byte `4t + E`.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn codes<const F: u8, const HIGH: bool, const E: usize, const CG: usize>(
            q: &[*const u8; CG],
            t: usize,
        ) -> [[V; NV]; CG] {
            // Byte codes of inputs 16.. are quads 4.. (one byte per input).
            let quad = if kind::bytes(F) && HIGH { 4 + t } else { t };
            let mut v = [[zero(); NV]; CG];
            for c in 0..CG {
                for h in 0..NV {
                    if kind::float(F) {
                        // Float codes: input `k`'s 16 columns side by side.
                        let k = if HIGH { 16 } else { 0 } + 4 * t + E;
                        let size = kind::float_bytes(F);
                        // SAFETY: `q[c]` points at a whole group-block of codes.
                        v[c][h] = unsafe {
                            let p = q[c].add((GROUP * k + LANES * h) * size);
                            match F {
                                kind::F16 => f16s(p.cast()),
                                kind::BF16 => bf16s(p.cast()),
                                _ => f32s(p.cast()),
                            }
                        };
                        continue;
                    }
                    // SAFETY: `q[c]` points at a whole group-block of codes.
                    v[c][h] = unsafe {
                        let p = q[c].add(4 * GROUP * quad + 4 * LANES * h);
                        match (kind::bytes(F), HIGH, E) {
                            (true, _, 0) => byte::<24>(p),
                            (true, _, 1) => byte::<16>(p),
                            (true, _, 2) => byte::<8>(p),
                            (true, _, _) => byte::<0>(p),
                            (false, false, 0) => nibble::<0>(p),
                            (false, false, 1) => nibble::<8>(p),
                            (false, false, 2) => nibble::<16>(p),
                            (false, false, _) => nibble::<24>(p),
                            (false, true, 0) => nibble::<4>(p),
                            (false, true, 1) => nibble::<12>(p),
                            (false, true, 2) => nibble::<20>(p),
                            (false, true, _) => nibble::<28>(p),
                        }
                    };
                }
            }
            v
        }

        /// `acc = fma(p, d, acc)`, then (formats with a minimum) `acc = fma(s, m, acc)` with the
        /// rows' block sums. (`Q6K` ends each half with [`finish_half`] instead.)
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn finish_block<const F: u8, const RT: usize, const CG: usize>(
            acc: &mut Acc<RT, CG>,
            p: &Acc<RT, CG>,
            d: &[[V; NV]; CG],
            m: &[[V; NV]; CG],
            sr: &[*const f32; RT],
            b: usize,
        ) {
            for r in 0..RT {
                // SAFETY: Q4 rows have a sum per block.
                let s = if kind::has_min(F) { unsafe { splat(sr[r].add(b)) } } else { zero() };
                for c in 0..CG {
                    for h in 0..NV {
                        acc[r][c][h] = fma(p[r][c][h], d[c][h], acc[r][c][h]);
                        if kind::has_min(F) {
                            acc[r][c][h] = fma(s, m[c][h], acc[r][c][h]);
                        }
                    }
                }
            }
        }

        /// `acc = fma(p, scale, acc)`: the end of one half of a `Q6K` block, whose halves each
        /// have a scale.
        #[inline]
        #[target_feature(enable = $features)]
        fn finish_half<const RT: usize, const CG: usize>(
            acc: &mut Acc<RT, CG>,
            p: &Acc<RT, CG>,
            scale: &[[V; NV]; CG],
        ) {
            for r in 0..RT {
                for c in 0..CG {
                    for h in 0..NV {
                        acc[r][c][h] = fma(p[r][c][h], scale[c][h], acc[r][c][h]);
                    }
                }
            }
        }
    };
}
