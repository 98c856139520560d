"""Learning: the retrieval MDP, soft PQN (and the SFT baseline), the training loop."""
