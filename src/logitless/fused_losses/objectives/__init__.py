"""The objective library: configs, the objective catalog, ratios, KL estimators, aggregations,
token selections, rollout correction and `policy_loss` on per-token values."""
