"""The front-end half of serving: HTTP, the OpenAI API, parsing, rendering. Imports no JAX, Keras or keras-hub."""
