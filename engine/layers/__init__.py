"""Model building blocks on pagedkernels ops."""
