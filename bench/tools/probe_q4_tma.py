"""Debug probe for q4_tma's decode on one small shape: where its output differs from the float64
reference (rows, tokens, a constant-scale variant)."""

import torch

from graphopt.kernels import q4

torch.manual_seed(0)
for n, k, m, bm in ((64, 256, 16, 16), (64, 256, 8, 8), (64, 256, 1, 8), (200, 512, 1, 8), (128, 512, 16, 16)):
    w = torch.randn(n, k) * 0.05
    qw, sc = q4.quantize_weight(w)
    for const_scales in (False, True):
        sc_used = torch.ones_like(sc) if const_scales else sc
        qw_c, sc_c = qw.cuda(), sc_used.cuda()
        x = torch.randn(m, k).cuda().to(torch.bfloat16)
        cfg = q4.TileConfig("tma", bm, 64, 4, 4, 2, 1, "last")
        got = q4.q4_linear_triton(x, qw_c, sc_c, mode="separate", config=cfg).double().cpu()
        ref = q4.reference_q4_linear(x.double(), qw_c, sc_c).double().cpu()
        err = (got - ref).abs()
        bad_rows = (err.max(0).values > 1e-2 * ref.abs().max()).nonzero().flatten().tolist()
        bad_tok = (err.max(1).values > 1e-2 * ref.abs().max()).nonzero().flatten().tolist()
        print(f"n={n} k={k} m={m} bm={bm} const_scales={const_scales}: rel {err.max() / ref.abs().max():.3e}; "
              f"bad rows {len(bad_rows)} {bad_rows[:12]}; bad tokens {bad_tok[:16]}")
        if bad_rows:
            r = bad_rows[0]
            print("   got", got[:4, r].tolist(), "ref", ref[:4, r].tolist())
            ratio = got[0] / ref[0]
            print("   ratio row0 first 16:", [round(v, 3) for v in ratio[:16].tolist()])
