"""The token loss (data.task char, tokens, addition, chat): the next token's cross-entropy, a mean
per micro-batch, or over every scored token of the step where rows score varying numbers (chat's
answers, packed documents without their first targets). Its modules: loss (the cross-entropy,
compiled with the blocks), objective (behind triax.objectives' interface)."""
