"""The decoders meshtrain trains (GPT, Llama): plain torch, no distribution."""
