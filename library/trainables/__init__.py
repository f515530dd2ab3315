"""What a trainer trains (the second axis of a trainer; the first is the model family,
``library.training.families``). One module each: ``lora`` (a LoRA / LyCORIS network)."""
