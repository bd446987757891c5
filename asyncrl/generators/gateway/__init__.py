"""An OpenAI-compatible gateway through which any agent program is trained: the program, in any
language, sees only a base URL; the gateway samples its calls with the generator's engine and
turns them into samples, token in, token out (``asyncrl.generators.gateway.agent_rollout``)."""
