"""The precision planner (docs/planner.md): :func:`quantlab.planner.flow.make_plan` runs its
stages in order, each a function in the module that owns its work returning one record:
``prepare`` (Prepared) -> ``rules`` (Rules) -> ``scales`` (Calibrated) -> ``hard_samples``
(HardSamples) -> ``trials`` (NoiseModel) -> ``choose`` (Search) -> ``decisions`` (Plan).
:mod:`quantlab.plan` re-exports the public names."""
