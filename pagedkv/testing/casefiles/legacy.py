"""DEPRECATED: the dialect of case files written before the property registry, read through this one
path so those files still replay; every file pagedkv writes (and every shipped regression) names a
property. Remove once no supported version writes check-function names.
"""

from __future__ import annotations

#: DEPRECATED: the check-function names files written before the property registry record, and the
#: property each maps to (``{transform}`` / ``{op}``: the record's transform / the invalid call's op).
#: Read by :func:`upgrade_legacy_check` only; new files always name a property.
LEGACY_CHECKS = {
    "gather_matches_definition": ("Case", "gather_returns_exactly_what_each_slot_holds"),
    "scatter_round_trip": ("Case", "scatter_then_gather_round_trips_and_touches_no_other_slot"),
    "write_kv_matches_definition": ("Case", "write_kv_lands_at_slot_mapping_and_skips_negative_slots"),
    "attention_matches_reference": ("Case", "paged_attention_matches_fp64_dense_reference"),
    "alone_equals_in_batch": ("Case", "a_request_alone_equals_the_same_request_in_a_batch"),
    "decode_matches_prefill": ("Case", "decoding_token_by_token_equals_one_prefill_and_chunked_prefill"),
    "backends_agree": ("Case", "backends_agree_on_every_op_both_provide"),
    "invariant_under": ("Case", "outputs_are_bit_identical_under_{transform}"),
    "check_rejected": ("InvalidCall", "{op}_rejects_bad_arguments_and_writes_nothing"),
    "sharing_isolated": ("CacheScenario", "every_live_sequence_reads_only_its_own_tokens"),
    "prefix_cache_transparent": ("CacheScenario", "prefix_caching_changes_no_output"),
}


def upgrade_legacy_check(record: dict) -> dict:
    """DEPRECATED path, kept so case files from earlier versions still replay: a record whose ``check``
    names a check function (:data:`LEGACY_CHECKS`) gets the property name instead (``legacy_check``
    keeps the old one, ``transform`` is dropped). A record naming a property is returned unchanged."""
    if record["check"] not in LEGACY_CHECKS:
        record.pop("transform", None)
        return record
    out = dict(record)
    op = record["case"].get("op") if record["kind"] == "InvalidCall" else None
    out["legacy_check"] = record["check"]
    out["check"] = LEGACY_CHECKS[record["check"]][1].format(transform=record.get("transform"), op=op)
    out.pop("transform", None)
    return out
