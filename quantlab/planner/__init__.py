"""The planner's steps, one module each; :mod:`quantlab.plan` runs them in order."""
