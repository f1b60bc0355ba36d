"""offremat: keep, offload or recompute each activation to train within a GPU memory budget."""
