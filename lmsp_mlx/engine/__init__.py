"""Model loading, prompt rendering, the generation loop and the one worker that owns the model."""
