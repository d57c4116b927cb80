"""The node program: runs one learner of a p2pdiloco swarm."""
