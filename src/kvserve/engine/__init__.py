"""Engine layer: requests, sampling, the scheduler, the step loop and its asyncio front."""
