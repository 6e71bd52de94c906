"""dspark: confidence-scheduled speculative decoding."""
