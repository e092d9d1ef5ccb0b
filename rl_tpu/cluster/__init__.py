"""The cluster: where actors run and how they are called. Device kinds and backends (`device`), Ray start-up
and placement plans and groups (`placement`), how trainer ranks meet and pick their devices (`rendezvous`), CPU
threads and cores (`cores`, `core_loan`), actor calls with
deadlines (`calls`), each actor's log (`actor_logs`) and memory (`memory`), and the items each role's memory
estimate is made of (`memory_items`).

May import models, sync, data, config and records; never a role (trainer, sampler, grader) or the controller.
"""
