"""One module per line of SGLang internals the true-off gate runs on (`specgate.sglang.trueoff.ADAPTERS`).

Each module gives the same names: LINE and RELEASES (what it was checked against), CONTRACT and FIELDS
(every SGLang internal it uses, `specgate.sglang.contract`), TARGETS and FORWARD_PARAMS (the hooked
methods), and the functions that touch SGLang's objects: arm, plain_decode_runner, plain_step,
draft_extend, target_checks, server_args, tp_rank, slot_of and release_hooks.
"""
