"""``asyncrl bench vs-trl``: asyncrl and trl side by side on the same model, task and samples."""
