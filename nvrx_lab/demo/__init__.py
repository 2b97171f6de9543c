"""The workbook's demo workloads: small training loops with scheduled faults (:mod:`.worker`) and the
mixed-dtype state the checkpoint demos save (:mod:`.state`)."""
