"""What ``ttft_tiers.py`` found, judged and printed: its targets (:func:`verdicts`) and the
tables (:func:`print_report`). Works on the result dict alone, as the benchmark writes it to
JSON."""
from __future__ import annotations

TARGETS = {
    "disk_hit_speedup": 10.0,  # recompute TTFT / disk-hit TTFT
    "cpu_hit_speedup": 20.0,  # recompute TTFT / CPU-pool-hit TTFT
    "restore_vs_plain_read": 0.70,  # restore bandwidth / plain read bandwidth, each tier
    "offload_slowdown": 0.05,  # 1 - (tiers-on throughput / tiers-off throughput)
}


def verdicts(r: dict) -> list[tuple[str, float, str, bool]]:
    t = TARGETS
    cpu_ratio = r["cpu_restore_bytes_per_s"] / r["cpu_plain_bytes_per_s"]["contiguous"]
    disk_ratio = r["disk_restore_bytes_per_s"] / r["disk_plain_bytes_per_s"]["pread"]
    disk_strict = r["disk_restore_bytes_per_s"] / r["disk_plain_bytes_per_s"]["preadv_into"]
    disk_speedup = r["recompute_s"] / r["disk_first_hit_s"]
    cpu_speedup = r["recompute_s"] / r["cpu_hit_s"]
    ratio_goal = f">= {t['restore_vs_plain_read']:.2f}"
    slow_goal = f"<= {t['offload_slowdown']:.2f}"
    return [
        ("disk hit (fresh process) vs recompute, TTFT", disk_speedup,
         f">= {t['disk_hit_speedup']:.0f}x", disk_speedup >= t["disk_hit_speedup"]),
        ("CPU-pool hit vs recompute, TTFT", cpu_speedup, f">= {t['cpu_hit_speedup']:.0f}x",
         cpu_speedup >= t["cpu_hit_speedup"]),
        ("CPU-pool restore / copy_ into a contiguous tensor", cpu_ratio, ratio_goal,
         cpu_ratio >= t["restore_vs_plain_read"]),
        ("disk restore / pread", disk_ratio, ratio_goal, disk_ratio >= t["restore_vs_plain_read"]),
        ("disk restore / preadv into preallocated buffers", disk_strict, ratio_goal,
         disk_strict >= t["restore_vs_plain_read"]),
        ("offload slowdown, decode tok/s", r["offload"]["decode_slowdown"], slow_goal,
         r["offload"]["decode_slowdown"] <= t["offload_slowdown"]),
        ("offload slowdown, output tok/s (prefill included)", r["offload"]["output_slowdown"],
         slow_goal, r["offload"]["output_slowdown"] <= t["offload_slowdown"]),
    ]


def print_report(r: dict) -> None:
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    gbs = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    rec = r["recompute_s"]
    print(f"TTFT, {r['prefix_tokens']}-token prefix + {r['suffix_tokens']}-token suffix, "
          "max_tokens=1:")
    print("| case | TTFT ms | of which tier load ms | speedup vs recompute | cached tokens |")
    print("|---|---|---|---|---|")
    repeats = r["repeats"]
    later_disk_load = (r["disk_load_s"] - r["disk_first_load_s"]) / repeats
    rows = [
        ("recompute (no tiers)", rec, None, 0),
        ("recompute, tiers on (stores the prefix)", r["recompute_with_tiers_s"], None, 0),
        ("engine-pool hit", r["engine_hit_s"], None, r["engine_hit_cached_tokens"]),
        ("CPU-pool hit", r["cpu_hit_s"], r["cpu_load_s"] / repeats, r["cpu_hit_cached_tokens"]),
        ("disk hit, first request of a fresh process", r["disk_first_hit_s"],
         r["disk_first_load_s"], r["disk_hit_cached_tokens"]),
        ("disk hit, later requests (median)", r["disk_hit_s"], later_disk_load,
         r["disk_hit_cached_tokens"]),
    ]
    if "remote_hit_s" in r:
        later_remote_load = (r["remote_load_s"] - r["remote_first_load_s"]) / repeats
        rows += [
            ("remote hit (loopback), first request of a fresh engine", r["remote_first_hit_s"],
             r["remote_first_load_s"], r["remote_hit_cached_tokens"]),
            ("remote hit (loopback), later requests (median)", r["remote_hit_s"],
             later_remote_load, r["remote_hit_cached_tokens"]),
        ]
    for name, seconds, load, cached in rows:
        load_ms = "" if load is None else ms(load)
        print(f"| {name} | {ms(seconds)} | {load_ms} | {rec / seconds:.1f}x | {cached} |")
    print()
    print("Restore bandwidth (KV bytes restored / the manager's load time) against plain reads")
    print("of the same bytes in the same process (CPU caches cold):")
    print("| tier | restore GB/s | plain read | plain read GB/s | ratio |")
    print("|---|---|---|---|---|")
    cpu, disk = r["cpu_plain_bytes_per_s"], r["disk_plain_bytes_per_s"]
    cpu_bw, disk_bw = r["cpu_restore_bytes_per_s"], r["disk_restore_bytes_per_s"]
    rows = [
        ("CPU pool", cpu_bw, "copy_ per block, contiguous (engine layout)", cpu["contiguous"]),
        ("disk, all requests", disk_bw, "pread per block", disk["pread"]),
        ("disk, all requests", disk_bw, "preadv into preallocated", disk["preadv_into"]),
        ("disk, first request", r["disk_first_restore_bytes_per_s"], "pread per block",
         disk["pread"]),
    ]
    for tier, restore, plain, plain_bw in rows:
        print(f"| {tier} | {gbs(restore)} | {plain} | {gbs(plain_bw)} | {restore / plain_bw:.2f} |")
    if "remote_restore_bytes_per_s" in r:
        print(f"| remote (loopback), all requests | {gbs(r['remote_restore_bytes_per_s'])} "
              "| | | |")
    print()
    o = r["offload"]
    print(f"Offload overhead: {o['prompts']} distinct prompts x {o['prompt_tokens']} tokens, "
          f"max_tokens={o['max_tokens']}, {o['rounds']} rounds alternating, medians:")
    print("| tiers | output tok/s | decode tok/s |")
    print("|---|---|---|")
    for name in ("off", "on"):
        m = o["median"][name]
        print(f"| {name} | {m['output_tok_s']:.1f} | {m['decode_tok_s']:.1f} |")
    print(f"slowdown: output {100 * o['output_slowdown']:.1f} %, "
          f"decode {100 * o['decode_slowdown']:.1f} %; "
          f"{o['blocks_stored_disk']} blocks stored on disk, {o['blocks_dropped_disk']} dropped")
    print()
    print("| target | measured | goal | result |")
    print("|---|---|---|---|")
    for name, value, goal, ok in verdicts(r):
        print(f"| {name} | {value:.2f} | {goal} | {'PASS' if ok else 'MISS'} |")
