"""The EAGLE-3 example: regenerate a target's answers, capture its hidden states with hslake, train
a draft with speculators or SpecForge fed by hslake's adapters, and measure speculative decoding."""
