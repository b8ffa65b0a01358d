"""The table of docs/benchmarks.md, "Real workers: 80% in alternating rounds", from rounds.py's rounds.json files
(one per set, given in order: A, B, ...). Usage: python rounds_table.py rounds80_A.json rounds80_B.json"""
import json, sys, statistics as st
sets = sys.argv[1:]
rows = []
for k, path in enumerate(sets):
    d = json.load(open(path))
    for r in d['rounds']:
        r = dict(r); r['set'] = chr(ord('A') + k); rows.append(r)
short = {'w0:int8/1t/q0.7': 'q0.7', 'w1:fp32/2t/q0.5': 'fp32', 'w2:int8/1t/q0.3': 'q0.3'}
print("| set-round | configuration | p50 ms | p99 ms | goodput/s | host CPU | share q0.7 / fp32 / q0.3 | mean tokens q0.7 / fp32 / q0.3 | p99 ms q0.7 / fp32 / q0.3 | p99 tail (top 1%) by worker q0.7 / fp32 / q0.3 |")
print("|---|---|---:|---:|---:|---:|---|---|---|---|")
fs = lambda x: format(x['share'], '.0%')
ft = lambda x: format(x['mean_tokens'], '.0f')
fp = lambda x: format(x['p99_s']*1e3, '.0f')
for r in rows:
    w = r['workers']; keys = list(short)
    g = lambda f: " / ".join(f(w[k]) if k in w else "-" for k in keys)
    tail = " / ".join(str(r['tail_workers'].get(k, 0)) for k in keys)
    print(f"| {r['set']}{r['round']} | {r['configuration']} | {r['p50_s']*1e3:.1f} | {r['p99_s']*1e3:.1f} | {r['goodput_rps']:.1f} | {r['host_cpu']:.0%} | "
          f"{g(fs)} | {g(ft)} | {g(fp)} | {tail} |")
print()
by = {}
for r in rows: by.setdefault(r['configuration'], []).append(r)
for c, rs in by.items():
    p99 = [r['p99_s']*1e3 for r in rs]; p50 = [r['p50_s']*1e3 for r in rs]
    print(f"{c}: n={len(rs)} p99 median {st.median(p99):.1f} min {min(p99):.1f} max {max(p99):.1f}; p50 median {st.median(p50):.1f}; goodput median {st.median([r['goodput_rps'] for r in rs]):.1f}")
# paired ratios per set-round
pairs = {}
for r in rows: pairs.setdefault((r['set'], r['round']), {})[r['configuration']] = r
for k, v in pairs.items():
    if 'inferlb_ext_proc' in v:
        peers = {c: x['p99_s'] for c, x in v.items() if c != 'inferlb_ext_proc'}
        best = min(peers, key=peers.get)
        print(k, f"inferlb/{best} = {v['inferlb_ext_proc']['p99_s']/peers[best]:.2f}x", {c: f"{v['inferlb_ext_proc']['p99_s']/p:.2f}" for c, p in peers.items()})
