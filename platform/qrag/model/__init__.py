"""The Q-network and what it is made of: encoders, RoPE positions, checkpoints, CUDA-graph encoders
(states; chunks while indexing)."""
