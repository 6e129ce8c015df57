"""What a manager's declarations (:class:`~.protocol.ManagerCapabilities`) turned on and off in one run of
the manager machine, for the verdict: each promise the machine judges only where it is declared, with the
programs that declared it, and each input the machine draws only for a manager that declares it.

A declaration left off is not a failure: a manager may honestly not promise a hit or an admission rule.
But it waives a judgement, and a reader of a green verdict must see which: a manager that stops caching
passes where ``hit_promise`` is off, one that refuses reservations with blocks free passes where
``admission`` is off, one that never releases a window's blocks passes where ``window_release`` is off,
and a hit across two cache salts is never drawn where ``namespaces`` is off.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.testing.managers.protocol import ManagerCapabilities

#: Promises the machine judges only where declared: name -> (is it declared, the judgement it turns on).
PROMISES = {
    "hit_promise": (lambda c: bool(c.hit_promise),
                    "a committed full block stays hittable until it is handed out again, evicted or reset "
                    "(not judged beside a Mamba group)"),
    "admission": (lambda c: c.admission is not None,
                  "a reservation or load is refused only when the pool is short"),
    "window_release": (lambda c: bool(c.window_release),
                       "right after a reservation, a window's or chunk's blocks no later query reads are -1"),
    "eviction_order": (lambda c: c.eviction_order == "lru",
                       "blocks handed out afresh come from the front of an LRU free queue (only 'lru' is judged)"),
    "cached_prompt": (lambda c: bool(c.cached_prompt),
                      "right after a prefill's first output, the cached prompt tokens reported are at least what the "
                      "request's own tables hold cached (full blocks, prompt-tail entries) and at most what it "
                      "reserved (judged where every group is full attention or a sliding window)"),
}

#: Where a declared promise cannot be judged: name -> (the programs where it is not, why). Such programs count
#: neither as judging it nor as waiving it; the verdict names them.
UNJUDGED = {
    "hit_promise": (lambda c: _beside_mamba(c) and not c.hit_alignment,
                    "beside a Mamba group no hit is promised (its states are cached at boundaries the manager "
                    "chooses); only the replay promise of hit_alignment would judge one"),
    "cached_prompt": (lambda c: _beside_mamba(c), "beside a Mamba group the cached-prompt count is not judged"),
}

#: Declarations that narrow a promise the manager keeps: name -> (does it narrow it, how). Each is honest where the
#: engine works that way (vLLM's EAGLE drop, its multi-module MTP re-prefill, sparse retention; the hit promise of a
#: manager that promises no admission rule, SGLang's), and a green verdict names it.
QUALIFIERS = {
    "min_computed_on_full_hit": (lambda c: c.min_computed_on_full_hit > 1,
                                 "a hit leaves more than the prompt's last token to compute (the hit promise that "
                                 "many tokens shorter)"),
    "eagle_drop": (lambda c: bool(c.eagle_drop), "a hit drops its last block where drafts are on (the hit promise "
                                                 "one block shorter)"),
    "reprefill": (lambda c: c.reprefill > 0, "a reservation's last tokens are left uncached where drafts are on"),
    "hit_promise without admission": (lambda c: bool(c.hit_promise) and c.admission is None,
                                      "refusals unjudged: a request refused at its first reservation or load (or "
                                      "at admit) escapes the hit promise"),
    "loads_keep_held": (lambda c: bool(c.loads_keep_held and c.connector),
                        "a connector load leaves unwritten the tokens whose blocks a group's longer hit holds (a host "
                        "tier's pages), judged as the reads find them"),
    "stored_groups": (lambda c: c.stored_groups is not None and bool(c.connector),
                      "a freed request waiting for its store holds only the groups the store reads"),
    "retention_interval": (lambda c: c.retention_interval is not None,
                           "sparse prefix-cache retention: a window group caches only the blocks a kept boundary "
                           "needs"),
}

#: Inputs and calls the machine draws only for a manager that declares them: name -> what goes undrawn.
DRAWS = {
    "namespaces": "cache salts and LoRA namespaces (a hit across two namespaces)",
    "extra_keys": "multimodal extra keys (a hit across two images)",
    "prompt_embeds": "prompt embeddings",
    "defers_commit": "reservations left unwritten (an abort between reserve and write)",
    "preempt": "preemption and re-admission",
    "resume": "preemption resumed with its output",
    "fork": "forks",
    "evict": "evictions on request",
    "reset": "prefix-cache resets",
    "async_steps": "asynchronous steps (a step reserved while the last one's writes are in flight)",
    "connector": "a KV connector's loads and stores",
    "token_loads": "connector loads ending inside a block (P/D disaggregation: the prompt less a backoff)",
    "speculative": "speculative drafts",
    "kv_events": "KV events (a router's prefix index rebuilt from them, judged against the cache)",
    "misuse": "misuse (declared refusals raise and change nothing: the API rules)",
    "zeroes_new_blocks": "the worker's zeroing of blocks handed out afresh (a connector load's landing after its data)",
}


def _beside_mamba(caps: ManagerCapabilities) -> bool:
    return any(g.kind == "mamba" for g in caps.groups)


def _applies(name: str, caps: ManagerCapabilities) -> bool:
    """Whether promise ``name`` can be judged for a manager declaring ``caps``."""
    if name == "window_release" and not _windowed(caps):
        return False
    return not (name in UNJUDGED and UNJUDGED[name][0](caps))


def _windowed(caps: ManagerCapabilities) -> bool:
    """Whether ``window_release`` can apply: a window, or a sliding-window or chunked-local group."""
    return caps.window is not None or any(g.kind in ("sliding_window", "chunked_local") for g in caps.groups)


def summarize(seen: Iterable[tuple[ManagerCapabilities, int]]) -> dict:
    """The declarations of a run, for the JSON verdict.

    Args:
        seen: each distinct :class:`ManagerCapabilities` a program's manager declared, with the number of
            programs that declared it.

    Returns:
        ``{"programs": N, "promises": {name: {"judgement", "declared_in", "applicable_in"}}, "waived":
        [promise names left undeclared in a program where they apply], "qualified": {name: {"what",
        "declared_in"}} (the :data:`QUALIFIERS` declared in some program), "unjudged": {name: {"what",
        "declared_in"}} (promises declared in programs where they cannot be judged, :data:`UNJUDGED`),
        "drawn": {name: programs}, "not_drawn": {name: what}}`` (an input of :data:`DRAWS` in ``drawn`` was
        declared in that many programs, one in ``not_drawn`` by none).
    """
    seen = list(seen)
    programs = sum(n for _, n in seen)
    promises = {}
    for name, (declared, judgement) in PROMISES.items():
        applies = [(c, n) for c, n in seen if _applies(name, c)]
        promises[name] = {"judgement": judgement, "declared_in": sum(n for c, n in applies if declared(c)),
                          "applicable_in": sum(n for _, n in applies)}
    waived = [name for name, p in promises.items() if p["declared_in"] < p["applicable_in"]]
    qualified = {name: {"what": what, "declared_in": sum(n for c, n in seen if narrows(c))}
                 for name, (narrows, what) in QUALIFIERS.items() if any(narrows(c) for c, _ in seen)}
    not_drawn = {name: what for name, what in DRAWS.items() if not any(getattr(c, name) for c, _ in seen)}
    drawn = {name: sum(n for c, n in seen if getattr(c, name)) for name in DRAWS if name not in not_drawn}
    unjudged = {name: {"what": what, "declared_in": sum(n for c, n in seen if PROMISES[name][0](c) and where(c))}
                for name, (where, what) in UNJUDGED.items()}
    return {"programs": programs, "promises": promises, "waived": waived, "qualified": qualified,
            "unjudged": {name: u for name, u in unjudged.items() if u["declared_in"]}, "drawn": drawn,
            "not_drawn": not_drawn}


def _merged(summaries: list, key: str, table: dict) -> dict:
    """The summaries' ``key`` entries (declarations named by ``table``: name -> (where, what)) added up."""
    return {name: {"what": what, "declared_in": sum(s.get(key, {}).get(name, {}).get("declared_in", 0)
                                                    for s in summaries)}
            for name, (_, what) in table.items() if any(name in s.get(key, {}) for s in summaries)}


def merge(summaries: Iterable[dict]) -> dict | None:
    """One summary for several searches of one manager (one per layout: :func:`summarize`'s, added up): the
    programs and each promise's ``declared_in`` / ``applicable_in`` summed, ``waived`` where any search waived
    it, ``not_drawn`` what no search drew. ``None`` for no summaries."""
    summaries = list(summaries)
    if not summaries:
        return None
    promises = {name: {"judgement": judgement,
                       "declared_in": sum(s["promises"][name]["declared_in"] for s in summaries),
                       "applicable_in": sum(s["promises"][name]["applicable_in"] for s in summaries)}
                for name, (_, judgement) in PROMISES.items()}
    qualified, unjudged = _merged(summaries, "qualified", QUALIFIERS), _merged(summaries, "unjudged", UNJUDGED)
    return {"programs": sum(s["programs"] for s in summaries), "promises": promises,
            "waived": [name for name, p in promises.items() if p["declared_in"] < p["applicable_in"]],
            "qualified": qualified, "unjudged": unjudged,
            "drawn": {name: sum(s.get("drawn", {}).get(name, 0) for s in summaries) for name in DRAWS
                      if any(name in s.get("drawn", {}) for s in summaries)},
            "not_drawn": {name: what for name, what in DRAWS.items()
                          if all(name in s["not_drawn"] for s in summaries)}}


def describe(summary: dict) -> str:
    """One line for the terminal summary: the promises judged, those waived (in how many programs), the
    declarations narrowing them and the inputs never drawn."""
    judged = [n for n, p in summary["promises"].items() if p["declared_in"]]
    waived = [f"{n} ({p['applicable_in'] - p['declared_in']} of {p['applicable_in']} programs)"
              for n, p in summary["promises"].items() if n in summary["waived"]]
    qualified = [f"{n} ({q['declared_in']} of {summary['programs']} programs)"
                 for n, q in summary.get("qualified", {}).items()]
    unjudged = [f"{n} ({u['declared_in']} of {summary['programs']} programs)"
                for n, u in summary.get("unjudged", {}).items()]
    drawn, programs = summary.get("drawn", {}), f"{summary['programs']} programs"
    return (f"manager promises judged: {', '.join(judged) or 'none'}; waived (not declared): "
            f"{', '.join(waived) or 'none'}; narrowed (declared): {', '.join(qualified) or 'none'}; "
            + (f"declared, not judgeable here: {', '.join(unjudged)}; " if unjudged else "")
            + f"drawn (declared): {', '.join(f'{n} ({k} of {programs})' for n, k in drawn.items()) or 'none'}; "
            + f"not drawn (not declared): {', '.join(summary['not_drawn']) or 'none'}")
