"""What ``gpu_tiers.py`` found, judged and printed: restore rates against their references,
the issue's targets for the device (:func:`verdicts`) and the tables (:func:`print_report`).
Works on the result dict alone, as the benchmark writes it to JSON."""
from __future__ import annotations

from typing import NamedTuple

from bench_common import SHAPES

STAGED_CPU_HIT = "CPU-pool hit, staged DMA"
WHOLE_DISK_HIT = "disk hit, whole load"  # on CUDA: the same hit, no head recomputed


class Verdict(NamedTuple):
    name: str
    value: float | None
    goal: str
    ok: bool | None  # None: not measured in this run


def restore_rows(r: dict) -> list[dict]:
    refs = {(x["shape"], x["prefix"]): x for x in r["references"]}
    out = []
    for t in r["ttft"]:
        tier = {"CPU-pool hit": "cpu", STAGED_CPU_HIT: "cpu", "disk hit": "disk",
                WHOLE_DISK_HIT: "disk",
                "remote hit": "remote"}.get(t["case"])
        if tier is None:
            continue
        ref = refs.get((t["shape"], t["prefix"]), {})  # none yet in a run cut short
        bps = t["restore_Bps"]
        name, ref_bps = {
            "cpu": ("pinned copy" if r["device"] == "cuda" else "memcpy", ref.get("copy_Bps")),
            "disk": ("pread into pinned" if r["device"] == "cuda" else "pread",
                     ref.get("pread_Bps")),
            "remote": (None, None),
        }[tier]
        out.append(dict(shape=t["shape"], prefix=t["prefix"], tier=tier, codec=t["codec"],
                        case=t["case"],
                        restore_Bps=bps, reference=name, reference_Bps=ref_bps,
                        blocks_per_copy=t.get("blocks_per_copy"),
                        ratio=None if ref_bps is None else bps / ref_bps))
    return out


def per_copy(value: float | None) -> str:
    """Blocks moved per copy call over a case's hits (a disk hit's copies include its
    slot-to-cache ones; a run older than the counter has none)."""
    return "" if value is None else f"{value:.1f}"


def find(rows: list[dict], **match) -> dict | None:
    return next((x for x in rows if all(x.get(k) == v for k, v in match.items())), None)


def verdicts(r: dict) -> list[Verdict]:
    """Every target of the issue for this device; restore ratios judged at the 8K prefix
    (else the largest measured), on the raw codec for disk."""
    cuda, restore, out = r["device"] == "cuda", restore_rows(r), []

    def check(name: str, value: float | None, goal: str, ok) -> None:
        out.append(Verdict(name, value, goal, None if value is None else ok(value)))

    for shape in r["shapes"]:
        judged = 8192 if 8192 in r["prefixes"] else max(r["prefixes"])
        cpu = max((x for x in restore if (x["shape"], x["prefix"], x["tier"], x["codec"])
                   == (shape, judged, "cpu", "raw")), key=lambda x: x["ratio"], default=None)
        goal = 0.80 if cuda else 0.70
        ref = "pinned copy" if cuda else "plain copy"
        check(f"{shape}@{judged}: CPU restore / {ref}", cpu and cpu["ratio"], f">= {goal:.2f}",
              lambda v, g=goal: v >= g)
        if cuda:
            # a whole load's rate where there is one: an overlapped hit loads only its tail
            disk = (find(restore, shape=shape, prefix=judged, case=WHOLE_DISK_HIT, codec="raw")
                    or find(restore, shape=shape, prefix=judged, tier="disk", codec="raw"))
            check(f"{shape}@{judged}: disk restore / pread", disk and disk["ratio"], ">= 0.50",
                  lambda v: v >= 0.50)
    if cuda:
        for shape, goal, ok in (("8b", "<= 0.50", lambda v: v <= 0.5),
                                ("1b", "< 1.00", lambda v: v < 1.0)):
            disk = find(r["ttft"], shape=shape, prefix=8192, case="disk hit", codec="raw")
            rec = find(r["ttft"], shape=shape, prefix=8192, case="recompute")
            value = disk and rec and disk["ttft_s"] / rec["ttft_s"]
            check(f"{shape}@8192: disk-hit TTFT / recompute", value, goal, ok)
    o = r.get("offload")
    check("offload overhead, decode tok/s", o and o["decode_overhead"], "<= 0.05",
          lambda v: v <= 0.05)
    check("offload overhead, decode tok/s, same engine detached", o and
          o["same_engine_decode_overhead"], "<= 0.05", lambda v: v <= 0.05)
    if cuda:
        check("cold request TTFT, tiers on / off", o and o["cold_ratio"], "<= 1.10",
              lambda v: v <= 1.10)
        d = find(r["on_disk"], shape="8b", prefix=32768, codec="raw")
        check("8b@32768: prompt's full blocks on disk after flush", d and
              d["on_disk"] / d["full_blocks"], "= 1.00", lambda v: v == 1.0)
    return out


def print_report(r: dict) -> None:
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    gbs = lambda b: "" if b is None else f"{b / 1e9:.2f}"  # noqa: E731
    print(f"TTFT, prefix + {r['suffix_tokens']} tokens, max_tokens=1, {r['device_name']}:")
    print("| shape | prefix | case | codec | TTFT ms | first ms | / recompute | cached / prefix |")
    print("|---|---|---|---|---|---|---|---|")
    for t in r["ttft"]:
        rec = find(r["ttft"], shape=t["shape"], prefix=t["prefix"], case="recompute")
        first = ms(t["first_s"]) if "first_s" in t else ""
        ratio = f"{t['ttft_s'] / rec['ttft_s']:.2f}" if rec else ""
        print(f"| {t['shape']} | {t['prefix']} | {t['case']} | {t['codec'] or ''} | "
              f"{ms(t['ttft_s'])} | {first} | {ratio} | "
              f"{t['cached_tokens']} / {t['prefix']} |")
    partial = [t for t in r["ttft"] if "hit" in t["case"] and t["cached_tokens"] < t["prefix"]]
    if partial:
        print(f"note: {len(partial)} hit cases served less than their prefix (cached / prefix); "
              "the rest of their prompt was recomputed (a disk or remote hit on an idle "
              "engine recomputes the head of its prefix while the rest loads, when loading "
              "all of it would take longer: an overlapped load)")
    for note in r["notes"]:
        print(f"note: {note}")
    print("\nRestore bandwidth (KV bytes loaded / the manager's load seconds, median over the "
          "hits) against a reference on the same bytes:")
    print("| shape | block KiB | prefix | tier | codec | restore GB/s | reference | ref GB/s "
          "| ratio | blocks per copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in restore_rows(r):
        kib = SHAPES[x["shape"]].block_nbytes >> 10
        ratio = "" if x["ratio"] is None else f"{x['ratio']:.2f}"
        tier = x["tier"] + {STAGED_CPU_HIT: " (staged DMA)", WHOLE_DISK_HIT: " (whole load)"}.get(
            x["case"], "")
        print(f"| {x['shape']} | {kib} | {x['prefix']} | {tier} | {x['codec'] or ''} | "
              f"{gbs(x['restore_Bps'])} | {x['reference'] or ''} | {gbs(x['reference_Bps'])} "
              f"| {ratio} | {per_copy(x['blocks_per_copy'])} |")
    print("\nFull prompt blocks on disk after flush (default settings, write-through):")
    print("| shape | codec | prefix | on disk / full blocks | share | dropped | flushed |")
    print("|---|---|---|---|---|---|---|")
    for d in r["on_disk"]:
        print(f"| {d['shape']} | {d['codec']} | {d['prefix']} | {d['on_disk']} / "
              f"{d['full_blocks']} | {100 * d['on_disk'] / d['full_blocks']:.1f} % | "
              f"{d['dropped']} | {d['flushed']} |")
    o = r.get("offload")
    if o:
        print(f"\nOffload overhead ({o['shape']}): {o['prompts']} prompts x {o['prompt_tokens']} "
              f"tokens + {o['max_tokens']} new, {o['rounds']} rounds taking turns; cold request "
              f"of {o['cold_tokens']} tokens; medians:")
        print("| tiers | output tok/s | decode tok/s | cold TTFT ms | cold: late GIL wake-ups, ms "
              "(longest) |")
        print("|---|---|---|---|---|")
        for name in ("off", "off-2", "off, both", "on", "on, detached"):
            m = o["median"][name]
            gil = (f"{m['cold_gil_late_ms']:.1f} ({m['cold_gil_longest_ms']:.1f})"
                   if "cold_gil_late_ms" in m else "–")
            print(f"| {name} | {m['output_tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                  f"{ms(m['cold_ttft_s'])} | {gil} |")
        print(f"overhead vs both tiers-off engines: decode {100 * o['decode_overhead']:.1f} % "
              f"(the two differ by {100 * o['decode_noise']:.1f} %), output "
              f"{100 * o['output_overhead']:.1f} %; cold {o['cold_ratio']:.2f}x; "
              f"{o['disk_stored_blocks']} blocks stored on disk, {o['disk_dropped']} dropped")
        print(f"same engine, connector detached for a round: decode overhead "
              f"{100 * o['same_engine_decode_overhead']:.1f} %, cold "
              f"{o['same_engine_cold_ratio']:.2f}x")
    print("\n| target | measured | goal | result |")
    print("|---|---|---|---|")
    for v in r["targets"]:
        result = "not measured" if v.ok is None else ("PASS" if v.ok else "MISS")
        value = "" if v.value is None else f"{v.value:.2f}"
        print(f"| {v.name} | {value} | {v.goal} | {result} |")
    if o and abs(o["decode_noise"]) > 0.05:
        print(f"note: the two tiers-off engines differ by {100 * o['decode_noise']:.1f} % in decode "
              "tok/s, more than the 5 % target: the offload verdict is within this run's noise")
