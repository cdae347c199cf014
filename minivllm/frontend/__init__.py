"""The process boundary, frontend side: what the server talks to (an EngineClient). In process, the
async engine runs the step loop on a thread; across processes, the client talks to the engine-core
process (core.py) in small typed messages (core_messages.py) and detokenizes on its side."""
