"""Hand-written English calibration text for GPTQ-style FP4 calibration of sentence encoders.

CALIBRATION_TEXTS: 282 short sentences (everyday life, nature, news, science, technology, health,
law, sport, culture, food and travel, questions, instructions, numbers and names) and 70 paragraphs
of a few sentences, written for this project; about 7,300 MiniLM tokens (the paragraphs half),
several times the largest linear input of MiniLM (its FFN down-projection, 1536 features), so each
layer's input Hessian is estimated from more tokens than it has columns. On MiniLM, GPTQ on a
subset of 196 of them (~4,100 tokens) instead of 24 sentences lifted the NVFP4 embedding cosine
mean from 0.989 to 0.992 (bench/fp4_minilm_quality.py's measure).
VALIDATION_SENTENCES: 40 further sentences that nothing calibrates on: a second held-out set, so
a quantizer's gain is not judged on the 10 evaluation sentences alone. No calibration text shares
four consecutive words with an evaluation or validation sentence, nor a validation sentence with
an evaluation sentence of bench/fp4_minilm_quality.py.
"""

from __future__ import annotations

SHORT_SENTENCES = [
    # everyday life
    "I left my keys on the kitchen table again this morning.",
    "The neighbours are painting their fence a bright shade of green.",
    "Could you pick up some milk and eggs on your way home?",
    "The baby finally fell asleep after an hour of gentle rocking.",
    "We moved the sofa closer to the fireplace for the winter.",
    "My phone battery dies before lunch ever since the last update.",
    "The laundry has been sitting in the machine since yesterday.",
    "He always takes the long way home so he can walk past the lake.",
    "Don't forget that the dentist appointment is on Tuesday at ten.",
    "The dog barked at the mail carrier for a full five minutes.",
    "Our apartment gets almost no sunlight in the afternoon.",
    "She wrapped the present in old newspaper because we ran out of paper.",
    "The kettle whistled just as the doorbell rang.",
    "They argued about whose turn it was to take out the rubbish.",
    "I can never remember where I parked the car at the mall.",
    "The smell of coffee drifted up the stairs and woke everyone.",
    # weather and nature
    "A thick layer of frost covered the windscreen at dawn.",
    "The river burst its banks after a week of steady rain.",
    "Hail the size of marbles dented cars across the valley.",
    "Autumn leaves blew across the empty car park.",
    "The forecast promises clear skies and a light westerly wind.",
    "Wildflowers bloomed along the roadside after the spring showers.",
    "A pair of herons nested in the reeds at the edge of the pond.",
    "The desert cools quickly once the sun goes down.",
    "Lightning struck the old oak tree during the night.",
    "Coral reefs are bleaching as ocean temperatures rise.",
    "Wolves have returned to several forests in central Europe.",
    "The glacier has retreated almost two kilometres in fifty years.",
    # news, politics, economics
    "The city council approved a budget for three new cycle lanes.",
    "Inflation slowed for the fourth consecutive month in June.",
    "The prime minister announced a cabinet reshuffle on Monday.",
    "Unemployment fell to its lowest level since the late nineties.",
    "The central bank left interest rates unchanged at four percent.",
    "Protesters gathered outside parliament to oppose the new tax.",
    "The airline reported record profits despite higher fuel costs.",
    "Housing prices in the capital have doubled over the past decade.",
    "The merger was blocked by regulators over competition concerns.",
    "Exports of wheat dropped after a poor harvest in the south.",
    "Voter turnout was higher than in any election this century.",
    "The company plans to cut two thousand jobs by the end of the year.",
    "Oil prices climbed after the pipeline was damaged in a storm.",
    "The treaty was signed by twenty-seven countries in Geneva.",
    # science
    "Water expands when it freezes, which is why ice floats.",
    "Enzymes speed up chemical reactions without being consumed.",
    "The speed of light in a vacuum is about three hundred thousand kilometres per second.",
    "DNA is copied before a cell divides into two daughter cells.",
    "Black holes bend light so strongly that nothing can escape them.",
    "The periodic table arranges elements by their atomic number.",
    "Vaccines train the immune system to recognise a pathogen.",
    "Plate tectonics explains why earthquakes cluster along fault lines.",
    "Bees communicate the location of flowers through a waggle dance.",
    "Saturn's rings are made mostly of ice and small rocks.",
    "Antibiotics do not work against viral infections such as the flu.",
    "The human brain contains roughly eighty-six billion neurons.",
    "Entropy in an isolated system never decreases over time.",
    "Octopuses can change the colour and texture of their skin.",
    "The half-life of carbon-14 is about five thousand seven hundred years.",
    "Sound travels faster through water than through air.",
    # technology and software
    "The database query timed out after thirty seconds.",
    "Run the migration script before deploying the new version.",
    "This function returns None when the list is empty.",
    "The server logs show a spike in failed login attempts.",
    "We switched from spinning disks to solid-state drives last year.",
    "A hash table gives constant-time lookups on average.",
    "The memory leak only appears after several days of uptime.",
    "Please attach a screenshot of the error message to the ticket.",
    "The new laptop has sixteen gigabytes of RAM and a fast processor.",
    "Encrypt the backup before uploading it to the cloud.",
    "The pull request needs two approvals before it can be merged.",
    "Caching the results cut the page load time in half.",
    "The robot vacuum keeps getting stuck under the bed.",
    "Open-source libraries power most of the modern web.",
    "The transformer model was fine-tuned on customer support chats.",
    "Set the environment variable and restart the service.",
    # health
    "Drink plenty of water during the hottest part of the day.",
    "The nurse checked his blood pressure twice before the operation.",
    "A balanced diet includes vegetables, grains and some protein.",
    "She sprained her ankle while running down the stairs.",
    "The clinic offers free flu shots for people over sixty-five.",
    "Stretching after exercise can reduce muscle soreness.",
    "Take one tablet twice a day with food for seven days.",
    "Long hours in front of a screen can strain your eyes.",
    # law and business
    "The defendant pleaded not guilty to all charges.",
    "Both parties must sign the agreement in the presence of a witness.",
    "The patent expires twenty years after the filing date.",
    "The judge adjourned the hearing until next Thursday.",
    "Employees are entitled to twenty-five days of paid leave.",
    "The invoice is due within thirty days of receipt.",
    "The startup raised five million dollars in its first funding round.",
    "Customer complaints rose sharply after the price increase.",
    "The auditors found no irregularities in the accounts.",
    "Our quarterly sales target was missed by a small margin.",
    # sport
    "The striker scored twice in the last ten minutes of the match.",
    "She broke the national record in the four hundred metres.",
    "The tennis final went to a fifth set tie-break.",
    "Rain delayed the start of the cricket match by two hours.",
    "The cyclists climbed the mountain stage in blistering heat.",
    "Our team has not lost a home game all season.",
    "The marathon route passes the cathedral and the old market.",
    "He trains at the swimming pool every morning before work.",
    # arts, culture, history
    "The museum acquired a rare collection of medieval manuscripts.",
    "Her first novel was translated into more than thirty languages.",
    "The band released their new album without any announcement.",
    "The film won three awards at the festival in Venice.",
    "The Roman aqueduct still carries water after two thousand years.",
    "The printing press made books affordable for ordinary people.",
    "The painter mixed his own pigments from crushed minerals.",
    "The choir sang carols in the town square on Christmas Eve.",
    "The castle was besieged for eight months during the war.",
    "Jazz emerged in New Orleans in the early twentieth century.",
    "The poet read aloud from her latest collection.",
    "The ballet company is touring Asia for the first time.",
    # food and travel
    "Slice the onions thinly and fry them until golden.",
    "This restaurant serves the best dumplings in town.",
    "Preheat the oven to two hundred degrees before baking.",
    "The ferry to the island runs twice a day in summer.",
    "We hiked to the top of the hill to watch the sunrise.",
    "The hotel room overlooked a busy square full of cafes.",
    "Remember to bring your passport and a printed copy of the booking.",
    "Street vendors sold grilled corn and spicy noodles.",
    "The night train arrives in Budapest just after six.",
    "Add a spoonful of honey to balance the acidity of the sauce.",
    "The market sells fresh fish straight from the boats.",
    "Our rental car broke down halfway across the desert.",
    # questions
    "What time does the library close on Saturdays?",
    "Why is the sky blue during the day and red at sunset?",
    "Can I pay by card, or do you only take cash?",
    "Who wrote the music for that old television series?",
    "Is it safe to swim in the lake this time of year?",
    "How do I change the language settings on my phone?",
    "Which platform does the express to the airport leave from?",
    "Do you know a good mechanic who could look at my bike?",
    "When was the first bridge across the river built?",
    "What is the difference between weather and climate?",
    "How long should I boil an egg for a soft yolk?",
    "Where did you learn to speak Portuguese so well?",
    # instructions, dialogue, short phrases
    "Turn left at the second traffic light and keep going straight.",
    "Press and hold the power button for ten seconds.",
    "Thanks so much for your help yesterday, it really made a difference.",
    "Sorry, I can't make it tonight, something came up at work.",
    "Fill in the form and return it to the front desk.",
    "Good morning everyone, let's get started with today's agenda.",
    "Happy birthday! I hope all your wishes come true.",
    "Keep this medicine out of the reach of children.",
    "No parking in front of the garage at any time.",
    "Great product, arrived on time and works exactly as described.",
    "Terrible service, we waited an hour and the food was cold.",
    "Meeting moved to 3 pm, room 204.",
    # numbers, names, dates, code-like text
    "The invoice number is 48213 and the total is 1,250 euros.",
    "Call us at 555-0199 between 9 am and 5 pm.",
    "The conference runs from 14 to 17 October 2025 in Berlin.",
    "Version 2.3.1 fixes the crash reported in issue 812.",
    "Dr. Okafor and Prof. Lindqvist published the study in 2021.",
    "Use pip install requests to add the library to your environment.",
    "The temperature dropped to minus 12 degrees Celsius overnight.",
    "The train covers the 420 km between the two cities in under two hours.",
    # everyday life (2)
    "The washing machine makes a grinding noise on the spin cycle.",
    "We ordered pizza because nobody felt like cooking.",
    "My cousin is getting married in a small chapel by the sea.",
    "The lift in our building has been broken for a week.",
    "He fell asleep on the train and missed his stop.",
    "I've started writing a shopping list on the back of old envelopes.",
    "The children built a fort out of blankets and chairs.",
    "Her new glasses make everything look sharper and brighter.",
    "The heating comes on automatically at six in the morning.",
    "We're repainting the hallway a softer shade of grey.",
    "Someone left a bicycle chained to our front gate.",
    "The toaster burns one side of the bread and barely warms the other.",
    # nature, animals, environment
    "Squirrels buried acorns all over the garden last autumn.",
    "The fog rolled in from the sea and hid the harbour lights.",
    "Frogs started croaking as soon as the sun went down.",
    "A swarm of locusts destroyed crops across the region.",
    "The national park is home to bears, elk and mountain lions.",
    "Recycling rates rose after the city introduced separate bins.",
    "The beach was covered in seaweed after the storm.",
    "Penguins huddle together to survive the Antarctic winter.",
    "Air pollution in the city is worst on still winter days.",
    "The old forest was cleared to make room for a motorway.",
    # news and economics (2)
    "The government promised to build a hundred thousand new homes.",
    "Shipping costs tripled when the canal was blocked.",
    "The strike by rail workers entered its third day.",
    "The mayor resigned after a scandal over public contracts.",
    "Consumer confidence improved slightly in the second quarter.",
    "The bank was fined for failing to prevent money laundering.",
    "Tourism revenue has recovered to pre-pandemic levels.",
    "The opposition leader called for an early general election.",
    "Food prices rose faster than wages for the second year running.",
    "The factory will switch to producing electric motors next year.",
    # science and maths
    "A prime number has exactly two divisors, one and itself.",
    "The moon always shows the same face to the Earth.",
    "Red blood cells carry oxygen from the lungs to the tissues.",
    "Diamonds and graphite are both made of pure carbon.",
    "The derivative of a function measures its rate of change.",
    "Some bacteria can survive in boiling hot springs.",
    "The Earth's magnetic field protects us from the solar wind.",
    "Hydrogen is the most abundant element in the universe.",
    "Probability theory began with questions about games of chance.",
    "Neutron stars are so dense that a teaspoon would weigh billions of tonnes.",
    "Insulin regulates the amount of sugar in the blood.",
    "A triangle's angles always add up to one hundred and eighty degrees.",
    "Tree rings record droughts and wet years going back centuries.",
    "Mercury is the smallest planet in the solar system.",
    # technology (2)
    "The printer says it is out of cyan even though the cartridge is new.",
    "Two-factor authentication makes accounts much harder to steal.",
    "The website was down for maintenance for most of Sunday.",
    "Our test suite takes forty minutes to run on every commit.",
    "He built a weather station from a small computer and a few sensors.",
    "The algorithm recommends videos based on what you watched before.",
    "Compress the images before you add them to the repository.",
    "The drone can fly for twenty-five minutes on a single charge.",
    "Most smartphones now unlock with a fingerprint or your face.",
    "The outage was caused by an expired security certificate.",
    "Variables declared inside the loop are not visible outside it.",
    "The GPU runs out of memory when the batch size exceeds sixty-four.",
    # health and body
    "Regular check-ups can catch problems before they become serious.",
    "He gave up sugar in his coffee and hardly misses it.",
    "The pharmacist explained how to use the inhaler.",
    "Children need more sleep than adults to grow and learn.",
    "Her knee still hurts when she walks downhill.",
    "The waiting room at the surgery was packed with coughing patients.",
    # law, work, business (2)
    "The lawyer advised her client not to answer any questions.",
    "Applications must be submitted before midnight on the deadline.",
    "The new manager changed the schedule without asking anyone.",
    "Shareholders voted against the chief executive's pay package.",
    "The tenancy agreement forbids keeping pets in the flat.",
    "Our supplier raised prices by ten percent from January.",
    "The police are appealing for witnesses to the accident.",
    "The company offers flexible hours and the option to work from home.",
    # sport (2)
    "The goalkeeper saved a penalty in the final minute.",
    "She has won the tournament three years in a row.",
    "The boxing match was stopped in the sixth round.",
    "Fans queued overnight for tickets to the final.",
    "The sailing race was postponed because there was no wind.",
    "The coach was sacked after a run of seven defeats.",
    # arts, history, culture (2)
    "The theatre is staging a modern version of an old comedy.",
    "The pyramids were built without iron tools or wheels.",
    "His paintings sold for very little during his lifetime.",
    "The library holds letters written by the city's founders.",
    "The documentary follows a family of farmers through one year.",
    "Folk songs were passed down orally for generations.",
    "The statue in the square commemorates a famous engineer.",
    "The empire collapsed after decades of civil war and plague.",
    "The author finished the last chapter just weeks before her death.",
    "The exhibition brings together photographs from five decades.",
    # food and travel (2)
    "Knead the dough for ten minutes until it is smooth and elastic.",
    "The cafe by the station makes excellent pastries.",
    "We missed the last bus and had to walk back to the hostel.",
    "The view from the cable car was breathtaking.",
    "This soup needs more salt and a squeeze of lemon.",
    "Our luggage was sent to the wrong city.",
    "The village is famous for its cheese and its cherry orchards.",
    "Bring warm clothes, the nights in the mountains are cold.",
    "Let the meat rest for a few minutes before carving it.",
    "The border crossing took longer than the rest of the journey.",
    # questions (2)
    "Have you ever tried to learn a musical instrument as an adult?",
    "What should I do if my flight is cancelled?",
    "How many people live in the largest city in Canada?",
    "Is this seat taken, or can I sit here?",
    "Why do cats purr when they are content?",
    "Could you explain how compound interest works?",
    "Where is the nearest cash machine?",
    "What are the symptoms of dehydration?",
    "Which programming language should a beginner learn first?",
    "Did anyone see where I put my reading glasses?",
    # instructions and conversation (2)
    "Unplug the device before cleaning it with a damp cloth.",
    "Please keep your voices down, the baby is sleeping.",
    "Let me know if you need anything else before the meeting.",
    "Shake well before use and store in a cool, dry place.",
    "I'm running ten minutes late, start without me.",
    "Congratulations on your new job, you really deserve it!",
    "Mind the gap between the train and the platform.",
    "Scan the code at the entrance to check in.",
    "The package was left with your neighbour at number twelve.",
    "Five stars, the hotel staff were friendly and the room was spotless.",
    # numbers, names, dates (2)
    "The bill came to 86 dollars including a 15 percent tip.",
    "Flight BA 117 departs from gate 32 at 18:45.",
    "In 1969 two astronauts walked on the moon.",
    "The population grew from 2.1 million to 2.8 million in thirty years.",
    "Ms. Rodriguez will replace Mr. Chen as head of sales on 1 March.",
    "The recipe needs 250 g of sugar and 3 large eggs.",
    "Room 5B is on the fifth floor, next to the lifts.",
    "Our Wi-Fi password is written on the card by the door.",
]

PARAGRAPHS = [
    "The village sits at the end of a narrow valley. In winter the road is often closed by snow, "
    "and the few hundred residents rely on a single shop for supplies. Most young people leave for "
    "the city, but a handful have returned to open guesthouses for hikers.",
    "Our team spent the sprint rewriting the payment service. The old code mixed database access "
    "with business logic, which made it hard to test. We split it into three modules, added "
    "integration tests, and cut the number of production incidents by half.",
    "Bananas are the most widely eaten fruit in the world. Nearly all exported bananas come from a "
    "single variety, which makes the crop vulnerable to disease. Researchers are breeding new "
    "varieties that resist a fungus spreading through plantations.",
    "The meeting started late because the projector would not connect. When it finally worked, the "
    "manager presented last quarter's figures. Sales were flat, costs had risen, and the room went "
    "quiet. Nobody wanted to be the first to ask about bonuses.",
    "Honeybees live in colonies of tens of thousands. The queen lays eggs, worker bees collect "
    "nectar and pollen, and drones exist mainly to mate. In cold weather the workers cluster around "
    "the queen and shiver their muscles to keep the hive warm.",
    "I bought this blender last month and I am disappointed. It is loud, the lid leaks when you blend "
    "anything liquid, and the blades already look dull. Customer service told me to wait another "
    "two weeks for a replacement part.",
    "The treaty ended a war that had lasted nearly thirty years. Borders were redrawn, new states "
    "were recognised, and religious tolerance was granted in principle. Historians still debate "
    "whether the peace was a turning point or merely a pause.",
    "To make a simple tomato sauce, warm olive oil in a pan and add crushed garlic. Before it "
    "browns, pour in a tin of chopped tomatoes, a pinch of salt and a little sugar. Simmer for "
    "twenty minutes and finish with torn basil leaves.",
    "The spacecraft will spend six years travelling to Jupiter. Once there, it will fly past three "
    "of the planet's icy moons, measuring the thickness of their crusts. Scientists hope to learn "
    "whether liquid oceans beneath the ice could support life.",
    "Dear Ms. Patel, thank you for your application for the position of data analyst. We were "
    "impressed by your experience and would like to invite you to an interview next week. Please "
    "let us know which of the attached time slots suits you best.",
    "The patient arrived with a high fever and a persistent cough. A chest X-ray showed signs of "
    "pneumonia, and she was started on antibiotics. After three days her temperature returned to "
    "normal and she was discharged with instructions to rest.",
    "Sorting algorithms differ in how they trade time for memory. Merge sort always runs in n log n "
    "time but needs extra space, while quicksort works in place and is usually faster in practice. "
    "Its worst case, however, is quadratic.",
    "The match was goalless at half time. Early in the second half the visitors scored from a "
    "corner, and the home side pressed for an equaliser. It finally came in stoppage time, a "
    "curling shot from outside the box that sent the crowd into raptures.",
    "Renting a flat in the city has become almost impossible for students. Landlords ask for three "
    "months of deposit, and viewings attract dozens of applicants. Some students now commute two "
    "hours a day from towns where rents are lower.",
    "The museum's new wing is built almost entirely of timber. The architects chose wood to reduce "
    "the carbon footprint of construction, and the large glass roof lets daylight fall on the "
    "sculptures below. It opens to the public in the spring.",
    "Photographers often prefer the hour after sunrise and the hour before sunset. The low sun "
    "produces long shadows and warm colours, and the light is softer than at midday. Many "
    "landscape pictures you admire were taken in these brief windows.",
    "The contract states that either party may terminate the agreement with ninety days' written "
    "notice. Any outstanding invoices must be settled before termination takes effect. Disputes "
    "shall be resolved by arbitration under the rules of the chamber of commerce.",
    "My grandfather worked in the shipyard for forty years. He started as an apprentice welder at "
    "fifteen and retired as a foreman. He still talks about the day the largest ship they ever "
    "built slid down the ramp into the harbour.",
    "Solar panels convert sunlight directly into electricity. Their efficiency has improved steadily "
    "while prices have fallen by more than ninety percent in two decades. Storing the energy for "
    "the night, though, remains expensive.",
    "Before you submit the report, check the figures in the second table. The totals do not match "
    "the summary on the first page, and two of the charts use different scales. Also, the "
    "conclusion should mention the limitations of the survey.",
    "The orchestra's new conductor is only twenty-nine. In her first season she has programmed "
    "works by living composers alongside the usual classics. Ticket sales are up, and the average "
    "age of the audience has dropped noticeably.",
    "Language models predict the next word from the words before it. Trained on enormous amounts "
    "of text, they can write essays, answer questions and translate. They can also state false "
    "things with great confidence, which is why their output needs checking.",
    "It rained for the whole of our holiday. We visited every museum in the town, played cards in "
    "the hotel lounge and ate far too much cake. On the last morning the clouds finally lifted, "
    "just as the taxi arrived to take us to the station.",
    "The company's annual report shows revenue of 3.2 billion dollars, up eight percent on the "
    "previous year. Operating margin improved to fourteen percent. The board proposes a dividend "
    "of 1.10 dollars per share, payable in May.",
    "Rivers carry sediment from the mountains to the sea. Where a river meets the coast, the "
    "sediment settles and builds a delta. Dams upstream trap much of this material, so many deltas "
    "are now shrinking and sinking.",
    "Hi Tom, just a quick note about Saturday. The barbecue starts at four, and you don't need to "
    "bring anything except maybe some drinks. If it rains we'll move everything into the garage. "
    "See you there!",
    "The bug only appeared on machines with more than one graphics card. The driver assigned "
    "devices in a different order after each reboot, so the program sometimes used the slower "
    "card. Pinning the device by its identifier fixed the problem.",
    "Medieval cities were surrounded by walls with a few guarded gates. Merchants paid tolls to "
    "bring goods inside, and the gates were closed at night. As cities grew, new suburbs spread "
    "beyond the walls, which were eventually torn down to make way for boulevards.",
    "The school introduced a four-day week for older pupils this year. Teachers say attendance has "
    "improved, but some parents struggle to arrange care on the fifth day. The council will review "
    "the trial in the summer.",
    "Whales sing complex songs that can travel hundreds of kilometres under water. Within a "
    "population all males sing the same song, and it slowly changes from year to year. Sometimes a "
    "new song spreads across an entire ocean basin.",
    "The recipe serves four. You will need 500 grams of potatoes, two leeks, a litre of stock and a "
    "splash of cream. Cook the vegetables until soft, blend until smooth, and season well with "
    "salt and white pepper.",
    "After the earthquake, volunteers arrived from all over the country. They cleared rubble, "
    "cooked meals and set up tents for families whose homes were destroyed. Rebuilding, officials "
    "say, could take more than a decade.",
    "The phone has a larger screen than last year's model and a better camera, but the battery "
    "life is about the same. It no longer comes with a charger in the box. At this price, most "
    "people will be happier keeping their current phone.",
    "Ancient sailors navigated by the stars. The pole star stays almost fixed in the northern sky, "
    "so its height above the horizon gives the latitude. Longitude was much harder, and was only "
    "solved when accurate clocks could be carried at sea.",
    "The training run diverged after twelve thousand steps. The loss suddenly jumped and never "
    "recovered. Lowering the learning rate and clipping the gradient norm made it stable, though "
    "convergence was somewhat slower.",
    "Every spring the town holds a festival in honour of its patron saint. A procession winds "
    "through the streets, bands play in the square, and stalls sell sweets and toys. In the "
    "evening fireworks are launched from the castle walls.",
    "Coffee was first cultivated in Yemen and spread through the Ottoman Empire. By the seventeenth "
    "century coffee houses had opened in London, where merchants met to trade news and make deals. "
    "Some of those meetings grew into insurance companies and stock exchanges.",
    "Question: is it better to rent or buy a home? It depends on how long you plan to stay, the "
    "price of homes relative to rents, and the interest rate on a mortgage. Buying usually pays "
    "off only if you stay for several years.",
    "The firefighters reached the farm within fifteen minutes, but the barn was already lost. They "
    "managed to save the house and most of the animals. Investigators believe the fire was started "
    "by a faulty heater in the workshop.",
    "In the final chapter the detective gathers everyone in the library. One by one she dismisses "
    "the suspects, until only the quiet gardener remains. His motive, it turns out, goes back to "
    "an event thirty years earlier.",
    "The old lighthouse on the headland was automated in the nineteen-eighties. The keeper's cottage "
    "stood empty for years until a local charity turned it into a small museum. Visitors can now "
    "climb the spiral staircase and look out over the rocks where dozens of ships were wrecked.",
    "Every morning the market square fills with stalls selling vegetables, cheese and flowers. By "
    "noon most of the traders have packed up, and the square is given back to the pigeons and the "
    "people drinking coffee on the cafe terraces.",
    "The software crashed whenever a user uploaded a file with a very long name. The upload "
    "handler copied the name into a fixed-size buffer without checking its length. The fix was "
    "three lines long; finding the bug took two weeks.",
    "Sleep researchers recommend going to bed and getting up at the same time every day. Screens "
    "should be switched off an hour before bed, and the bedroom should be cool, dark and quiet. "
    "Caffeine late in the afternoon can disturb sleep for hours.",
    "The river once powered dozens of mills along its banks. Some ground grain, others spun "
    "cotton or sawed timber. Today only one mill still turns, restored by volunteers who give "
    "demonstrations to school groups on summer weekends.",
    "I really enjoyed this book. The characters felt real, the dialogue was sharp, and the plot "
    "kept me guessing until the very end. My only complaint is that the middle section drags a "
    "little. Still, I would recommend it to anyone who likes a good mystery.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow "
    "is compressed into ice, which slowly flows downhill under its own weight. As it moves, the "
    "ice carves valleys and carries rocks far from where they started.",
    "The negotiations lasted through the night. By dawn the two sides had agreed on a ceasefire, "
    "an exchange of prisoners and a timetable for further talks. Few observers expect the deal to "
    "solve the underlying conflict, but it may save lives in the coming months.",
    "Thank you for contacting customer support. We are sorry to hear that your order arrived "
    "damaged. A replacement has been dispatched and should reach you within three working days. "
    "You do not need to return the damaged item.",
    "The first computers filled entire rooms and used thousands of vacuum tubes. They were slow, "
    "unreliable and extremely expensive. The invention of the transistor, and later the integrated "
    "circuit, made computers smaller, cheaper and vastly more powerful.",
    "Our garden is small, but we grow a surprising amount of food in it. There are beans along "
    "the fence, lettuce in the shade of the apple tree, and strawberries in pots by the door. "
    "The snails, unfortunately, like it as much as we do.",
    "The study followed ten thousand adults for twenty years. Those who walked at least thirty "
    "minutes a day had a lower risk of heart disease, even after accounting for diet and smoking. "
    "The authors caution that the study shows an association, not proof of cause.",
    "The theatre was almost empty on the opening night. By the end of the week, after a glowing "
    "review in the local paper, every seat was sold. The run was extended twice, and the play "
    "later transferred to a larger venue in the capital.",
    "To install the shelf, first mark the positions of the brackets with a pencil. Check that the "
    "marks are level, then drill the holes and insert wall plugs. Screw the brackets in place and "
    "rest the shelf on top before fixing it from below.",
    "Trade routes across the desert linked the Mediterranean with West Africa for centuries. "
    "Caravans of camels carried salt south and returned with gold, ivory and cloth. Cities along "
    "the routes grew rich and became famous centres of learning.",
    "The interview went better than I expected. They asked about my last project, how I handle "
    "deadlines and why I want to change jobs. At the end they showed me around the office, which "
    "I took as a good sign. They promised to call by Friday.",
    "Volcanoes are not only destructive. The ash they produce weathers into some of the most "
    "fertile soils on Earth, which is why farmers live on the slopes of active volcanoes despite "
    "the danger. Geothermal heat from volcanic areas can also generate electricity.",
    "The new timetable adds an extra train every hour at peak times. Passengers had complained for "
    "years about overcrowding on the morning services. The rail company says the change was made "
    "possible by the arrival of ten new trains.",
    "The cat appeared at our back door one rainy evening, thin and soaked. We gave it some milk, "
    "and it came back the next night, and the night after that. Six months later it sleeps on our "
    "bed and behaves as if it has always lived here.",
    "Machine translation has improved enormously in the last decade. Systems trained on millions "
    "of translated sentences now produce fluent text in many languages. They still struggle with "
    "idioms, rare words and languages for which little training data exists.",
    "The hospital is recruiting nurses from abroad to fill hundreds of vacancies. Staff say they "
    "are exhausted after years of working extra shifts. Union leaders argue that better pay would "
    "keep more nurses in the profession.",
    "On the first day of the course, students learn to tie the basic knots. By the end of the week "
    "they can raise the sails, steer a small boat and bring it back to the mooring. The instructor "
    "says most people are surprised by how quickly they learn.",
    "The painting was thought to be a copy until experts examined it with X-rays. Beneath the "
    "surface they found an earlier sketch that the artist had painted over, something a copyist "
    "would never do. The museum now lists it as an original.",
    "Prices are listed without tax. Orders over fifty euros are delivered free of charge; smaller "
    "orders cost five euros to ship. Items can be returned within thirty days if they are unused "
    "and in their original packaging.",
    "The mountain path is steep and rocky in places, so wear sturdy boots. Allow about four hours "
    "to reach the summit and three to come back down. There is no water on the route, and the "
    "weather can change suddenly, even in summer.",
    "A week before the election, the polls showed the two main candidates level. Turnout among "
    "young voters, usually low, was expected to decide the result. Both campaigns spent their "
    "final days touring universities and appearing on popular podcasts.",
    "Octopuses are remarkably intelligent for animals without a backbone. They can open jars, "
    "escape from tanks and recognise individual people. Most of their neurons are in their arms, "
    "which can act almost independently of the brain.",
    "When the power went out, the whole street came outside. Someone lit a barbecue, someone else "
    "brought a guitar, and children ran between the houses with torches. When the lights came "
    "back on a few hours later, people were almost disappointed.",
    "The algorithm splits the data into two halves, sorts each half recursively and merges the "
    "results. Because each level of recursion does a linear amount of work and there are "
    "logarithmically many levels, the total running time is n log n.",
    "Our quarterly newsletter is here. This issue covers the opening of our new branch, an "
    "interview with our longest-serving employee and tips for saving energy at home. As always, "
    "we welcome your feedback and suggestions for future topics.",
]

CALIBRATION_TEXTS = SHORT_SENTENCES + PARAGRAPHS

VALIDATION_SENTENCES = [
    "The bakery on the corner closes early on Sundays.",
    "Mount Everest grows a few millimetres taller every year.",
    "Please remove your shoes before entering the temple.",
    "The referee showed him a red card for a dangerous tackle.",
    "Our internet connection drops every evening around eight.",
    "The ancient Greeks believed the gods lived on Mount Olympus.",
    "Interest rates on savings accounts remain disappointingly low.",
    "The toddler refused to eat anything green on his plate.",
    "Magnets attract iron but not aluminium or copper.",
    "The concert hall's acoustics are praised by musicians worldwide.",
    "Lock the door behind you when you leave the office.",
    "A sudden gust of wind blew the umbrella inside out.",
    "The jury deliberated for two days before reaching a verdict.",
    "Which museum has the largest collection of impressionist paintings?",
    "The app crashes whenever I try to upload a photo.",
    "Cheetahs are the fastest land animals over short distances.",
    "The parliament will vote on the healthcare bill next week.",
    "Grate the cheese and sprinkle it over the pasta before serving.",
    "My sister is studying marine biology at university.",
    "The satellite sends images back to Earth every ninety minutes.",
    "Traffic on the motorway was backed up for ten kilometres.",
    "This jacket is waterproof but surprisingly light.",
    "The hospital opened a new wing for children with cancer.",
    "He apologised for forgetting their anniversary.",
    "Tides are caused mainly by the gravitational pull of the moon.",
    "Store the vaccine between two and eight degrees Celsius.",
    "The startup's app lets users split restaurant bills instantly.",
    "The lighthouse keeper lived alone on the rock for twenty years.",
    "Can you recommend a good book about the history of mathematics?",
    "The landlord raised the rent by fifteen percent without warning.",
    "Copper wires conduct electricity with very little resistance.",
    "She scored the winning basket with one second left on the clock.",
    "The wedding reception was held in a barn decorated with fairy lights.",
    "Restart your computer to finish installing the updates.",
    "The drought has left the reservoir at a third of its capacity.",
    "The professor's lecture on game theory was packed with students.",
    "Wash your hands thoroughly before preparing food.",
    "The ship's cargo included grain, timber and machine parts.",
    "Our neighbour's cat sleeps on our doorstep every afternoon.",
    "The museum is free to visit on the first Sunday of each month.",
]
