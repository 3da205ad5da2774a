"""The capacity run's tables and its ``--json`` record, from what its two processes measured."""

from __future__ import annotations

import statistics

from _common import print_table

SLACK = 512 << 20  # what the process may hold besides the cache: Python, torch, a batch
FLOOR_GOAL = 1.3  # the step within this of max(in-memory step, misses per step / disk reads per second)
MIB = 1 << 20


def _runs(memory: dict, tiered: dict, ids_per_step: int) -> list[dict]:
    """Per distribution and read-ahead mode: the step, its floor, and the counts per step.

    The cache counts a batch's distinct ids (``hit_rate``); ``missed_ids`` is misses over all ids.
    """
    rate = next(_best(d) for d in tiered["disk"] if d["queue_depth"] == tiered["queue_depth"])
    out = []
    for dist, modes in tiered["runs"].items():
        for mode, r in modes.items():
            steps = r["steps"]
            per = {k: r[k] / steps for k in ("misses", "written_back", "relocated", "bytes_read", "bytes_written",
                                             "disk_bytes_read", "disk_bytes_written")}  # fmt: skip
            step = statistics.median(r["seconds"])
            floor = max(memory["step_s"][dist], per["misses"] / rate)
            looked = r["hits"] + r["misses"]
            out.append({"ids": dist, "prefetch": mode == "on", "step_s": step, "memory_step_s": memory["step_s"][dist],
                        "floor_s": floor, "vs_floor": step / floor, "hit_rate": r["hits"] / looked if looked else 0.0,
                        "missed_ids": per["misses"] / ids_per_step,
                        "steps": steps, **{f"{k}_per_step": v for k, v in per.items()}})  # fmt: skip
    return out


def _summary(config: dict, memory: dict, tiered: dict, counts: dict | None) -> list[tuple[str, str]]:
    bound = config["cache_bytes"] + SLACK
    rss = tiered["peak_rss"]
    cap = f"{config['cap_bytes'] / MIB:.0f} MiB" if counts else "none"
    rows = [
        ("table", f"{config['rows']} x {config['dim']} ({config['rows'] * tiered['record_bytes'] / MIB:.0f} MiB "
                  f"with state: {tiered['record_bytes']} B records)"),
        ("batch", f"{config['batch']} bags x {config['bag']} ids, sum, fused RowWiseAdagrad"),
        ("cache / cap", f"{config['cache_bytes'] / MIB:.0f} MiB ({tiered['capacity_rows']} rows) / {cap}"),
        ("cache bookkeeping (outside the cache: index, per-slot records)",
         f"{tiered.get('bookkeeping_bytes', 0) / MIB:.0f} MiB"),
        ("tiered child's allocator", "glibc's defaults" if config.get("glibc_defaults") else
         "MALLOC_MMAP_THRESHOLD_=262144 MALLOC_TRIM_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2"),
        ("made (file filled, widened)", f"{tiered['made_s']:.1f} s"),
        ("peak RSS / (cache + 512 MiB)", f"{rss / MIB:.0f} / {bound / MIB:.0f} MiB: "
                                         + ("within" if rss <= bound else "OVER")),
        ("peak RSS after: " + ", ".join(tiered["peak_rss_after"]),
         " / ".join(f"{v / MIB:.0f}" for v in tiered["peak_rss_after"].values()) + " MiB"),
        ("cache filled with the hottest rows", f"{tiered['prefill_s']:.1f} s"),
        ("in-memory twin's peak RSS (uncapped)", f"{memory['peak_rss'] / MIB:.0f} MiB"),
        ("cgroup peak (page cache too)", f"{counts['peak'] / MIB:.0f} MiB, at the cap {counts['failcnt']} times, "
                                         f"{counts['oom_kills']} OOM kills" if counts else "no cgroup"),
    ]  # fmt: skip
    for d in tiered["disk"]:
        rows.append((f"disk, queue depth {d['queue_depth']}",
                     f"{d['reads_per_s']:.0f} / {d.get('reads_per_s_after', float('nan')):.0f} random reads/s of "
                     f"{tiered['record_bytes']} B before / after the steps ({d['reads']} reads, "
                     f"{d['disk_bytes_per_read']:.0f} B from the disk each)"))  # fmt: skip
    return rows


def _best(probe: dict) -> float:
    """The faster of a depth's probes, before and after the steps: the lower floor, so the stricter verdict."""
    return max(probe["reads_per_s"], probe.get("reads_per_s_after", 0.0))


def report(config: dict, memory: dict, tiered: dict, counts: dict | None) -> dict:
    """Print the run's two tables; the record ``--json`` writes."""
    print_table(["capacity run", "value"], _summary(config, memory, tiered, counts),
                title="tables larger than memory: capped-memory run")  # fmt: skip
    runs = _runs(memory, tiered, config["batch"] * config["bag"])
    rows = [
        (f"{r['ids']}, prefetch {'on' if r['prefetch'] else 'off'}", f"{r['step_s'] * 1e3:.1f}",
         f"{r['memory_step_s'] * 1e3:.1f}", f"{r['floor_s'] * 1e3:.1f}",
         f"{r['vs_floor']:.2f}x " + ("within" if r["vs_floor"] <= FLOOR_GOAL else "OVER"), f"{r['hit_rate']:.3f}",
         f"{r['misses_per_step']:.0f} ({r['missed_ids']:.1%})",
         f"{r['written_back_per_step']:.0f} / {r['relocated_per_step']:.0f}",
         f"{r['bytes_read_per_step'] / MIB:.2f} / {r['bytes_written_per_step'] / MIB:.2f}",
         f"{r['disk_bytes_read_per_step'] / MIB:.2f} / {r['disk_bytes_written_per_step'] / MIB:.2f}")
        for r in runs
    ]  # fmt: skip
    title = (
        f"floor: max(in-memory step, misses / reads per s at queue depth {tiered['queue_depth']}, the faster "
        "of its probes before and after the steps)"
    )
    print_table(["ids, read-ahead", "step ms", "in memory ms", "floor ms", f"vs floor (<= {FLOOR_GOAL}x)",
                 "hit rate", "misses / step (of ids)", "written back / moved by the log, a step",
                 "tier MiB read / written per step",
                 "disk MiB read / written per step"],
                rows, title=title)  # fmt: skip
    depth = {d["queue_depth"]: {**d, "reads_per_s_before": d["reads_per_s"], "reads_per_s": _best(d)}
             for d in tiered["disk"]}  # fmt: skip
    return {"config": config, "record_bytes": tiered["record_bytes"], "capacity_rows": tiered["capacity_rows"],
            "made_s": tiered["made_s"], "prefill_s": tiered["prefill_s"], "peak_rss": tiered["peak_rss"],
            "peak_rss_after": tiered["peak_rss_after"], "bookkeeping_bytes": tiered.get("bookkeeping_bytes"),
            "memory_peak_rss": memory["peak_rss"],
            "rss_bound": config["cache_bytes"] + SLACK,
            "cgroup": counts, "disk": {str(k): v for k, v in depth.items()}, "tier_queue_depth": tiered["queue_depth"],
            "runs": runs, "floor_goal": FLOOR_GOAL}  # fmt: skip
