"""Ingestion: scored trajectories from producers outside the learner, checked, grouped, held within a byte budget
and buffered, behind LearnerService."""
