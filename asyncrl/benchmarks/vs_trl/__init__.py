"""``asyncrl bench vs-trl``: asyncrl and trl's GRPOTrainer on the same work, timed from the command."""
