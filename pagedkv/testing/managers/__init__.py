"""Cache managers under one state machine: the engine-agnostic protocol (:mod:`.protocol`), the content
oracle (:mod:`.oracle`), the machine (:mod:`.machine`), pagedkv's own cache through the protocol
(:mod:`.own`), a reference hybrid manager of every layout (:mod:`.reference`), a planted fault
(:mod:`.faults`) and replayable programs (:mod:`.programs`)."""
