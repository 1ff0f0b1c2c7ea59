"""The data plane: wire types, the replay buffer and service, and the weight channel."""
