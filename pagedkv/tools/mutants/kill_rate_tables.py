"""Kill-rate tables: a child's raw result (:func:`pagedkv.tools.mutants.kill_rates.run_job`) per mutant, as JSON
and markdown.

Per mutant (:func:`summarize`): a status, killed in ``k`` of ``n`` runs with the explicit examples and
with generated examples only, the median examples and seconds to the first failure (generated runs),
the property that fails first most often and the case file of the first failure.

=============  =====================================================================================
status         meaning
=============  =====================================================================================
``killed``     some run failed (a property, or the mutant did not import)
``crashed``    a run (or the child) died of a signal (a segmentation fault): killed by crash
``timeout``    the child ran past its budget plus :data:`~pagedkv.tools.mutants.kill_rates.GRACE_S` (a hang)
``survived``   every completed run passed: no property pins the mutated line down
``equivalent`` survived, and marked equivalent with an argument (``--equivalent ID=why``)
``error``      the child failed outside any property (the harness, not the mutant)
=============  =====================================================================================

:func:`line_table` groups the mutants by source line: a line with a non-equivalent survivor is a line
no property pins down. Follows the reporting of mutmut and cosmic-ray (survivors with their diffs),
with kill *probability* over seeds instead of one run.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

KILLED = ("killed", "crashed", "timeout")


def summarize(job: dict, result: dict, equivalent: dict[str, str] | None = None) -> dict:
    """One mutant's row: the job's identity and meta (operator, line, diff), its status and rates.

    Args:
        job: the :class:`~pagedkv.tools.mutants.kill_rates.Job` as a dict. result: what ``run_job`` returned.
        equivalent: ``{mutant id: why it is equivalent}``.
    """
    equivalent = equivalent or {}
    runs = list(result.get("runs", []))
    current = result.get("current")
    if result.get("signal") and current:  # the run in progress crashed the child
        case = current.get("case_file", "")
        runs.append({"seed": current["seed"], "explicit": current["explicit"], "killed": True, "crashed": True,
                     "property": current["property"], "examples": 0, "seconds": 0.0,
                     "error": f"child died of signal {result['signal']}",
                     "case_file": case if case and Path(case).is_file() else ""})
    if result.get("status") == "import_error":
        status, note = "killed", f"does not import: {result.get('error', '')}"
    elif result.get("signal"):
        status, note = "crashed", f"signal {result['signal']}"
    elif result.get("timed_out"):
        status, note = "timeout", f"stopped after {result.get('wall_s')} s" + (
            f" in {current['property']}" if current else "")
    elif result.get("status") == "no_result" or result.get("returncode"):
        status, note = "error", result.get("error", "") or f"exit status {result.get('returncode')}"
    elif any(r.get("crashed") for r in runs):  # forked runs: each crash ended its own run
        signals = ", ".join(map(str, sorted({r["signal"] for r in runs if r.get("signal")})))
        status, note = "crashed", f"signal {signals} in {sum(bool(r.get('crashed')) for r in runs)} of {len(runs)} runs"
    elif any(r["killed"] for r in runs):
        status, note = "killed", ""
    else:
        status, note = "survived", ""
        if job.get("module") and result.get("loaded_from") and result["loaded_from"] != job.get("path"):
            note = f"module loaded from {result['loaded_from']}, not the mutant"
        elif job.get("module") and not result.get("loaded_from"):
            note = f"{job['module']} was never imported by the backend"
    status, note = _marked(status, note, equivalent.get(job["id"]))
    row = {"id": job["id"], "kind": job["kind"], **job.get("meta", {}), "status": status, "note": note,
           "wall_s": result.get("wall_s"), "budget_spent": bool(result.get("budget_spent"))}
    if job.get("module"):  # a source mutant: was the mutated file what the backend ran?
        row["mutant_loaded"] = bool(result.get("loaded_from")) and result["loaded_from"] == job.get("path")
    for label, explicit in (("explicit", True), ("generated", False)):
        mine = [r for r in runs if r["explicit"] == explicit]
        row[f"{label}_killed"] = sum(r["killed"] for r in mine)
        row[f"{label}_runs"] = len(mine)
        row[f"{label}_partial"] = sum(bool(r.get("partial")) and not r["killed"] for r in mine)
    gen_kills = [r for r in runs if r["killed"] and not r["explicit"]]
    row["median_examples"] = statistics.median(r["examples"] for r in gen_kills) if gen_kills else None
    row["median_seconds"] = round(statistics.median(r["seconds"] for r in gen_kills), 2) if gen_kills else None
    killers = Counter(r["property"] for r in runs if r["killed"])
    row["first_property"] = killers.most_common(1)[0][0] if killers else ""
    row["case_file"] = next((r["case_file"] for r in runs if r.get("case_file")), "")
    row["error"] = next((r["error"] for r in runs if r["killed"]), "")
    row["runs"] = runs
    return row


def counts(rows: list[dict]) -> dict:
    """``{"generated", "killed", "crashed", "timeout", "survived", "equivalent", "error"}`` over ``rows``
    (``killed`` counts crashes and timeouts too)."""
    by = Counter(r["status"] for r in rows)
    return {"generated": len(rows), "killed": by["killed"] + by["crashed"] + by["timeout"], "crashed": by["crashed"],
            "timeout": by["timeout"], "survived": by["survived"], "equivalent": by["equivalent"],
            "error": by["error"]}


def line_table(rows: list[dict]) -> list[dict]:
    """Per source line (``file``, ``line``) with a mutant: mutants, killed, and the survivors (id, diff);
    ``pinned`` is false when a non-equivalent mutant of the line survived."""
    lines: dict[tuple, dict] = {}
    for r in rows:
        if "line" not in r:
            continue
        entry = lines.setdefault((r["file"], r["line"]), {"file": r["file"], "line": r["line"],
                                                          "source": r.get("before", ""), "mutants": 0,
                                                          "killed": 0, "survivors": [], "equivalent": []})
        entry["mutants"] += 1
        entry["killed"] += r["status"] in KILLED
        if r["status"] == "survived":
            entry["survivors"].append({"id": r["id"], "operator": r["operator"], "diff": r["diff"]})
        elif r["status"] == "equivalent":
            entry["equivalent"].append({"id": r["id"], "diff": r["diff"], "why": r["note"]})
    out = sorted(lines.values(), key=lambda e: (e["file"], e["line"]))
    for e in out:
        e["pinned"] = not e["survivors"]
    return out


def remark(rows: list[dict], equivalent: dict[str, str]) -> list[dict]:
    """``rows`` of an earlier report with the equivalence arguments ``{mutant id: why}`` applied as
    :func:`summarize` applies them: a survivor becomes ``equivalent`` with the argument as its note, a
    killed mutant keeps its status and its note says the argument is wrong. Nothing is rerun."""
    out = []
    for row in rows:
        status, note = _marked(row["status"], row["note"], equivalent.get(row["id"]))
        out.append({**row, "status": status, "note": note})
    return out


def _marked(status: str, note: str, why: str | None) -> tuple[str, str]:
    """``(status, note)`` with an equivalence argument ``why`` applied: a survivor (or a mutant already
    marked) becomes ``equivalent`` with ``why`` as its note; a killed one keeps its status and its note
    says the argument is wrong; no argument changes nothing."""
    if why and status in ("survived", "equivalent"):
        return "equivalent", why
    if why and status in KILLED:
        return status, f"marked equivalent ({why}) but killed: the argument is wrong"
    return status, note


def write_json(path: str | Path, config: dict, rows: list[dict]) -> None:
    """The whole report as JSON: ``config``, ``counts``, ``mutants`` (rows), ``lines`` (:func:`line_table`)."""
    Path(path).write_text(json.dumps({"config": config, "counts": counts(rows), "mutants": rows,
                                      "lines": line_table(rows)}, indent=1, default=str))


def _cell(text, width: int = 90) -> str:
    text = " ".join(str(text if text is not None else "").split()).replace("|", "\\|")
    return f"`{text if len(text) <= width else text[: width - 3] + '...'}`" if text else ""


def _rate(row: dict, label: str) -> str:
    n, partial = row[f"{label}_runs"], row.get(f"{label}_partial", 0)
    return (f"{row[f'{label}_killed']}/{n}" + ("*" * bool(partial))) if n else "-"


def markdown(config: dict, rows: list[dict], title: str = "") -> str:
    """The report as markdown: configuration, counts, one row per mutant, then the lines no property pins
    down with each survivor's diff."""
    c = counts(rows)
    out = [f"# {title or 'Mutation kill rates: ' + str(config.get('impl'))}", ""]
    out.append(" · ".join(f"{k}: {v}" for k, v in config.items() if k not in ("properties", "left_out")))
    out += ["", f"**{c['generated']} mutants: {c['killed']} killed ({c['crashed']} by crash, {c['timeout']} by "
                f"timeout), {c['survived']} survived, {c['equivalent']} equivalent, {c['error']} harness errors.**", ""]
    if config.get("properties"):
        out.append(f"Properties run ({len(config['properties'])}, in order): " + ", ".join(config["properties"]))
    if config.get("left_out"):
        out.append("Left out: " + "; ".join(f"{k} ({v})" for k, v in config["left_out"].items()))
    out += ["", "Rates are *killed runs / runs completed*, one run per seed: **explicit** runs the explicit "
            "examples first, **generated** draws examples only. Median examples and seconds are to the first "
            "failure in the generated runs. `*`: the last run was cut short by the time budget (it passed the "
            "properties it reached).", "",
            "| mutant | operator | diff | status | explicit | generated | median ex. | median s | "
            "fails first | case file / note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['id']} | {r.get('operator', r['kind'])} | {_cell(r.get('diff', ''), 110)} | {r['status']} | "
                   f"{_rate(r, 'explicit')} | {_rate(r, 'generated')} | {r['median_examples'] or ''} | "
                   f"{r['median_seconds'] or ''} | {r['first_property']} | "
                   f"{_cell(r['case_file'] or r['note'], 60)} |")
    table = line_table(rows)
    loose = [e for e in table if not e["pinned"]]
    out += ["", f"## Lines no property pins down ({len(loose)} of {len(table)} mutated lines)", ""]
    if loose:
        out += ["| line | source | killed | survivors (diff) |", "|---|---|---|---|"]
        for e in loose:
            survivors = "<br>".join(f"{s['id']} ({s['operator']}): {_cell(s['diff'], 80)}" for s in e["survivors"])
            out.append(f"| {Path(e['file']).name}:{e['line']} | {_cell(e['source'], 60)} | "
                       f"{e['killed']}/{e['mutants']} | {survivors} |")
    equiv = [x for e in table for x in e["equivalent"]]
    if equiv:
        out += ["", "## Equivalent mutants", "", "| mutant | diff | why |", "|---|---|---|"]
        out += [f"| {x['id']} | {_cell(x['diff'], 80)} | {x['why']} |" for x in equiv]
    return "\n".join(out) + "\n"
