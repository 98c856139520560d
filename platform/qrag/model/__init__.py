"""The Q-network and what it is made of: encoders, RoPE positions, checkpoints, the CUDA-graph state encoder."""
