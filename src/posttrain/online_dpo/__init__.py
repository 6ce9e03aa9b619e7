"""Online DPO: two completions per prompt from the policy, judged, then a DPO loss."""
