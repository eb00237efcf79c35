"""The minimal heterogeneous trainer: composes the model, data, balancer, weighted
reducer and loss scaler (`hetcomm train`)."""
