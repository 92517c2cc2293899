"""Expert parallelism for Mixture-of-Experts models (Mixtral): MoEConfig, routing with load
balancing, experts split over the EP group with all-to-all dispatch. Imports torch only (and the
transform package's own helpers)."""
