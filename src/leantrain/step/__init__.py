"""One optimizer step: the batch split, the accumulator, precision and loss scaling, losses, evaluation."""
