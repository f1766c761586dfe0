"""The GPU check's results as one printed table: a row per measurement of each part, then the goals."""

from __future__ import annotations

GOALS = {
    "curation": "images/s per GPU >= 150",
    "pretrain": "MFU >= 45%",
    "data_wait": "data wait < 3% of the step",
    "value": "pretrained ahead of random beyond the seed spread on every fine-tuning cell",
}


def setting_name(s: dict) -> str:
    """``compiled, ckpt selective, reshard never, prefetch 2, batch 16``: the pretraining step's setting."""
    return (
        f"{'compiled' if s['compile'] else 'eager'}, ckpt {s['activation_checkpointing']}, "
        f"reshard {s['reshard_after_forward']}, prefetch {s['prefetch']}, batch {s['batch']}"
    )


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def table_rows(parts: dict) -> list[tuple[str, str, str]]:
    """(part, measurement, value) rows of the printed table."""
    rows = []
    for part, r in parts.items():
        if r["status"] != "ok":
            rows.append((part, "ERROR", r.get("error", "")))
        if part == "curation":
            for p in r.get("sweep", []):
                rows.append(
                    (
                        part,
                        f"batch {p['batch']}: images/s running | from start | GPU util %",
                        f"{p['images_per_s_running']} | {p['images_per_s_from_start']} | {p['gpu_util_pct']}",
                    )
                )
            if r.get("images_per_s_per_gpu") is not None:
                how = "running" if r["best"]["images_per_s_running"] else "from the start"
                rows.append(
                    (part, f"images/s per GPU (batch {r['best']['batch']}, {how})", str(r["images_per_s_per_gpu"]))
                )
            for name, ms in r.get("ms_per_image", {}).items():
                rows.append((part, f"ms/image, {name}", f"{ms:.3f}"))
        elif part == "pretrain":
            if r.get("device"):
                peak = (
                    f"{r['peak_tflops']:g} TFLOPS ({r['peak_source']})"
                    if r.get("peak_tflops")
                    else r.get("peak_source")
                )
                rows.append(
                    (
                        part,
                        f"{r.get('size')} at {r.get('image')}, {r.get('device')}",
                        f"peak {peak}",
                    )
                )
            for run in r.get("runs", []):
                name = setting_name(run)
                value = run.get("error") or (
                    f"step {run['step_s']:.3f} s, {run['images_per_s']} img/s, {run['tokens_per_s']:,} tok/s, "
                    f"peak mem {run['peak_mem_gib'] or 'n/a'} GiB, MFU {percent(run['mfu'])}"
                )
                rows.append((part, name, value))
            if r.get("best"):
                rows.append((part, "best setting", setting_name(r["best"])))
            if r.get("flash_attention"):
                rows.append((part, "attention on the flash kernel alone (eager step)", r["flash_attention"]))
            for b in r.get("breakdowns", []):
                rows += breakdown_rows(b)
        elif part == "data_wait":
            for run in r.get("runs", []):
                path = " ".join(run["decode_path"]) or "the config's"
                rows.append(
                    (
                        part,
                        f"{setting_name(r['setting'])}, {r['shards_images']} curated images, decode path {path}",
                        f"data wait {run['data_wait_frac_mean']:.2%} of the step (max {run['data_wait_frac_max']:.2%}), "
                        f"step {run['step_s']:.3f} s, MFU {percent(run['mfu'])}",
                    )
                )
                if "step_s_during_async_save" in run:
                    rows.append((part, f"decode path {path}: async checkpoint", async_save_line(run)))
            for s in r.get("skipped", []):
                rows.append((part, f"decode path {' '.join(s['decode_path'])}", f"skipped: {s['why']}"))
        elif part == "value":
            rows += value_rows(r)
        rows.append((part, "seconds (budget)", f"{r['seconds']} ({r['budget_s']})"))
    return rows


def async_save_line(run: dict) -> str:
    """The steps after the timed ones, while their async checkpoint is written, against the timed steps."""
    save = run["async_save"]
    committed = run["async_save_committed_at"]
    return f"step {run['step_s_during_async_save']:.3f} s while it is written vs {run['step_s']:.3f} s without; " + (
        f"{save['stage_s']:.2f} s on the step path (staging), written in {save['write_s']:.2f} s, fingerprint "
        f"{save['summary_s']:.2f} s beside it, committed at step {committed}"
        if save
        else "not committed within the steps measured"
    )


def breakdown_rows(b: dict) -> list[tuple[str, str, str]]:
    """A profiled setting: its clock and totals, then a row per part of the step (ms per step, share)."""
    name = f"breakdown, {setting_name(b)}"
    if "parts" not in b:
        return [("pretrain", name, b.get("error") or f"skipped: {b.get('skipped')}")]
    rows = [
        (
            "pretrain",
            name,
            f"{b['clock']}: {b['total_ms']:.1f} ms/step summed over {b['steps']} profiled steps "
            f"({b['step_ms']:.1f} ms/step wall under the profiler)",
        )
    ]
    for p in b["parts"]:
        host = f", host {p['cpu_ms']:.2f} ms" if "cpu_ms" in p else ""
        rows.append(("pretrain", f"{name}: {p['part']}", f"{p['ms']:.2f} ms/step, {p['share']:.1%}{host}"))
    if b.get("other_top"):
        top = ", ".join(f"{e['name']} {e['ms']:.2f}" for e in b["other_top"])
        rows.append(("pretrain", f"{name}: other, by event (ms/step)", top))
    return rows


def value_rows(r: dict) -> list[tuple[str, str, str]]:
    """Per model size: what was trained, then pretrained vs random per measure (mean ± std over seeds, and whether the
    gain exceeds the seed spread), then the goal; for a size cut off mid-chain, the steps it finished."""
    rows = []
    verdict = {True: "yes", False: "no", None: "n/a"}
    for m in r.get("models", []):
        name = f"{m['size']} (patch {m['patch_size']})"
        rows.append(
            (
                "value",
                f"{name}: {m['pool']} renders, {m['pretrain_steps']} steps x {m['global_batch']} on each set",
                f"chain {m['seconds']} s",
            )
        )
        for source, p in m["pretraining"].items():
            run = m.get("pretrain_run", {}).get(source, {})
            rows.append(
                (
                    "value",
                    f"{m['size']}: pretrained on {source}, {p['images']} images ({p['epochs']:.1f} epochs)",
                    f"held-out MAE {p['heldout_mae']['initial']:.4f} at init -> {p['heldout_mae']['pretrained']:.4f}; "
                    f"{run.get('step_s', 'n/a')} s/step, {run.get('images_per_s', 'n/a')} img/s, MFU "
                    f"{percent(run.get('mfu'))}",
                )
            )
        for c in m["cells"]:
            rows.append(
                (
                    "value",
                    f"{m['size']}: {c['measure']}",
                    f"random {c['random']} | {c['init']} {c['pretrained']} | gain > seed spread "
                    f"{verdict[c['beyond_spread']]}",
                )
            )
        beyond = sum(1 for c in m["cells"] if c["beyond_spread"])
        rows.append(
            (
                "value",
                f"{m['size']}: pretrained beyond the seed spread on every fine-tuning cell",
                f"{verdict[m['goal_met']]} ({beyond} of {len(m['cells'])} cells of any init; ahead on "
                f"{sum(1 for c in m['cells'] if c['ahead'])})",
            )
        )
        rows += [("value", f"{m['size']}: verdict", v) for v in m.get("verdicts", [])]
    if r.get("current"):
        c = r["current"]
        done = "; ".join(f"{title} {secs} s" for title, secs in c["steps_s"].items())
        rows.append(("value", f"{c['size']}: unfinished (at: {c.get('running', 'n/a')})", done or "no step done"))
    for s in r.get("skipped", []):
        rows.append(("value", f"{s['size']}: skipped", s["why"]))
    return rows


def print_table(results: dict) -> None:
    rows = table_rows(results["parts"])
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    print(f"\n{results['device']} | torch {results['torch']} | {results['mode']}")
    print(f"{'part':<{widths[0]}}  {'measurement':<{widths[1]}}  value")
    for part, what, value in rows:
        print(f"{part:<{widths[0]}}  {what:<{widths[1]}}  {value}")
    print("goals: " + "; ".join(f"{p}: {g}" for p, g in GOALS.items()))
